"""Every `SamplingParams` field, on every surface: accepted, or refused with an error that
names it. Adding a field to the struct fails `test_every_field_has_a_value_here` until it
gets a value below, and then every surface is checked for it. Beam search refuses, on
every surface, each field it would ignore (`SamplingParams.beam_refusal`)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

import radixserve.lang as sgl
from radixserve.client import AsyncClient, Client, ServerError
from radixserve.messages import SamplingParams
from radixserve.messages.sampling import BEAM_SEARCH_FIELDS
from radixserve.server.http import openai_protocol
from tests.server.conftest import API_KEY

VALUES: dict[str, Any] = {
    "max_new_tokens": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
    "stop": ["\n\n"], "stop_token_ids": [5], "ignore_eos": True, "seed": 3,
    "frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.2,
    "skip_special_tokens": False, "no_stop_trim": True, "n": 2, "regex": "[a-z ]+",
    "json_schema": '{"type": "object"}', "ebnf": 'root ::= "a"+',
    "structural_tag": '{"type": "structural_tag", "structures": [{"begin": "<f>", '
                      '"schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f>"]}',
    "min_new_tokens": 1, "stop_regex": r"\d\d", "logit_bias": {"5": 1.0},
    "spaces_between_special_tokens": False, "sampling_seed": 3, "beam_width": 2,
    "speculative": "lookup", "stream_interval": 2, "custom_params": {"k": 1},
    "watermark": {"enabled": True},
}
"""A value that sets each field (differs from its default) and is valid on its own."""

REFUSED = {"watermark"}
"""Fields every surface refuses (by name) whatever the request."""

OPENAI_MAPPED = {"max_new_tokens": "max_tokens", "json_schema": "response_format",
                 "structural_tag": "tools"}
"""SamplingParams fields OpenAI's routes take under their own name and shape."""

PROMPT = "The capital of France is"
FIELDS = [f.name for f in msgspec.structs.fields(SamplingParams)]
BEAM_REFUSED = [f for f in FIELDS if f not in BEAM_SEARCH_FIELDS and f != "n"]


def sampling(field: str, **more: Any) -> dict[str, Any]:
    return {"max_new_tokens": 2, **more, field: VALUES[field]}


def test_every_field_has_a_value_here():
    assert sorted(VALUES) == sorted(FIELDS)
    for field, value in VALUES.items():  # each value really sets its field
        default = msgspec.structs.fields(SamplingParams)[FIELDS.index(field)].default
        assert value != default, field


def test_engine_and_rpc_clients(engine, http_runtime):
    """Engine, Client and AsyncClient: the accepted fields in one batch (one prompt per
    field), each refused one alone; with beam search, each field it would ignore."""
    accepted = [f for f in FIELDS if f not in REFUSED]
    batch = dict(prompt=[PROMPT] * len(accepted), sampling_params=[sampling(f)
                                                                    for f in accepted])
    address = http_runtime.rpc_address

    async def aio(calls: list[dict[str, Any]]) -> list[Any]:
        async with AsyncClient(address, timeout=300, api_key=API_KEY) as c:
            out: list[Any] = []
            for call in calls:
                try:
                    out.append(await c.generate(**call))
                except ServerError as e:
                    out.append(e)
            return out

    refusals = [dict(prompt=PROMPT, sampling_params=sampling(f)) for f in REFUSED] + [
        dict(prompt=PROMPT, sampling_params=sampling(f, beam_width=2))
        for f in BEAM_REFUSED]
    names = sorted(REFUSED) + BEAM_REFUSED
    with Client(address, timeout=300, api_key=API_KEY) as client:
        results = {"engine": engine.generate(**batch), "client": client.generate(**batch)}
        errors: dict[str, list[str]] = {"engine": [], "client": []}
        for call in refusals:
            for surface, generate, kind in (("engine", engine.generate, ValueError),
                                            ("client", client.generate, ServerError)):
                with pytest.raises(kind) as err:
                    generate(**call)
                errors[surface].append(str(err.value))
    *aio_results, = asyncio.run(aio([batch, *refusals]))
    results["aio"] = aio_results[0]
    errors["aio"] = [str(e) for e in aio_results[1:]]
    for surface, result in results.items():
        assert len(result) == len(accepted) + 1, surface  # n=2 answers twice
    for surface, messages in errors.items():
        for name, message in zip(names, messages, strict=True):
            assert f"sampling_params.{name}" in message, (surface, name, message)


def test_http_generate(http):
    accepted = [f for f in FIELDS if f not in REFUSED]
    got = http.post("/generate", json={"text": [PROMPT] * len(accepted),
                                       "sampling_params": [sampling(f) for f in accepted]})
    assert got.status_code == 200, got.text
    assert len(got.json()) == len(accepted) + 1
    for field in sorted(REFUSED):
        got = http.post("/generate", json={"text": PROMPT, "sampling_params": sampling(field)})
        assert got.status_code == 400 and field in got.json()["error"]["message"], got.text
    for field in BEAM_REFUSED:  # SGLang's spelling of beam search
        got = http.post("/generate", json={"text": PROMPT, "sampling_params": sampling(
            field, beam_width=2)})
        assert got.status_code == 400, (field, got.text)
        assert f"beam search does not support sampling_params.{field}" in \
            got.json()["error"]["message"]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_openai_routes(http, route):
    """A field OpenAI's request declares under its own name is accepted; one it maps is
    accepted in its own shape (tested with those shapes in test_openai.py); any other is
    an unknown field, refused by name. With beam search, each it would ignore is refused."""
    base = ({"prompt": PROMPT} if route == "/v1/completions"
            else {"messages": [{"role": "user", "content": PROMPT}]})
    base = {**base, "model": "smollm2-135m", "max_tokens": 2}
    for field in FIELDS:
        if field in OPENAI_MAPPED:
            continue
        got = http.post(route, json={**base, field: VALUES[field]})
        if field in openai_protocol.SAMPLING_FIELDS and field not in REFUSED:
            assert got.status_code == 200, (field, got.text)
            assert len(got.json()["choices"]) == (2 if field == "n" else 1)
        else:
            assert got.status_code == 400, (field, got.text)
            assert field in got.json()["error"]["message"], (field, got.text)
    for field in BEAM_REFUSED:
        if field not in openai_protocol.SAMPLING_FIELDS:
            continue
        got = http.post(route, json={**base, "use_beam_search": True, "n": 2,
                                     field: VALUES[field]})
        assert got.status_code == 400, (field, got.text)
        assert got.json()["error"]["param"] == field, got.text


@sgl.function
def one_gen(s, field):
    s += PROMPT + sgl.gen("out", **sampling(field))


def test_dsl(http_runtime):
    """The DSL's gen takes every field by name (n > 1 is refused: fork instead)."""
    endpoint = sgl.RuntimeEndpoint(http_runtime.rpc_address, timeout=300, api_key=API_KEY)
    try:
        states = one_gen.run_batch([{"field": f} for f in FIELDS], backend=endpoint)
        for field, state in zip(FIELDS, states):
            if field in REFUSED | {"n"}:
                assert field in str(state.error()), (field, state.error())
            else:
                assert state.error() is None, (field, state.error())
                assert isinstance(state["out"], str)
        with pytest.raises(TypeError, match="top_q"):
            sgl.gen("out", top_q=0.5)
    finally:
        endpoint.shutdown()
