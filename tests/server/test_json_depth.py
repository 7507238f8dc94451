"""`json_depth`, the HTTP body's nesting bound checked on the event loop before decoding:
brackets inside strings (escaped quotes included) never count, and a body of many strings
costs numpy passes, not a regex over every string (issue 41, finding 3). And what
`decode_body` refuses after decoding: a foreign field set off its default."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from starlette.requests import Request

from radixserve.server.http.errors import ApiError, decode_body, json_depth
from radixserve.server.http.native import GenerateBody
from radixserve.server.http.openai_protocol import ChatRequest


def test_brackets_inside_strings_do_not_count():
    nested = "[" * 70 + "]" * 70
    assert json_depth(json.dumps({"a": nested, "b": [[1]]}).encode()) == 3
    tricky = ('{"a": "\\\\", "b": "\\"[[{", "c": %s}' % nested).encode()
    assert json_depth(tricky) == 71
    assert json_depth(('{"s": "]]]]", "c": %s}' % nested).encode()) == 71


def test_a_body_of_many_strings_is_measured_in_passes():
    """8.8 MB of 640,000 strings: measured beside one json.loads of the same body (which a
    decode costs anyway), generously."""
    schema = {f"p{i}": {"type": "string"} for i in range(320_000)}
    raw = json.dumps({"s": schema, "deep": json.loads("[" * 70 + "]" * 70)}).encode()
    start = time.perf_counter()
    json.loads(raw)
    parse = time.perf_counter() - start
    start = time.perf_counter()
    assert json_depth(raw) == 71
    assert time.perf_counter() - start < max(2 * parse, 0.5)


def test_decode_body_refuses_a_foreign_field_off_its_default():
    """`decode_body` applies `foreign_fields.DefaultOnly` to every body it decodes: at its
    default such a field passes, at any other value it is a 400 naming it and why."""
    def request(body: dict) -> Request:
        async def receive() -> dict:
            return {"type": "http.request", "body": json.dumps(body).encode()}
        return Request({"type": "http", "method": "POST", "headers": []}, receive)

    body = asyncio.run(decode_body(request({"text": "hi", "image_data": None}), GenerateBody))
    assert body.text == "hi"
    with pytest.raises(ApiError) as e:
        asyncio.run(decode_body(request({"text": "hi", "image_data": "x.png"}), GenerateBody))
    assert (e.value.status, e.value.param) == (400, "image_data")
    assert e.value.message == "image_data is not supported: radixserve generates from text only"
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "function_call": "x"}
    with pytest.raises(ApiError) as e:
        asyncio.run(decode_body(request(chat), ChatRequest))
    assert e.value.param == "function_call"
