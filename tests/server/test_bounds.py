"""Issue 25, classes 1 and 2, over the real surfaces (RPC, /generate, the OpenAI routes):
numbers that size a caller's work (n, beams, top logprobs, logprob_start_len, batch sizes)
are refused with an error naming the field before any work, and bytes nested thousands
deep in any field are refused as a decode error, not a RecursionError that ended the
server. Each test then checks the server survived (tests/server/survival.py)."""

from __future__ import annotations

import time
from typing import Any, Iterator

import msgspec
import pytest

from radixserve.client import Client, ServerError
from radixserve.messages import MAX_BATCH, ErrorReply
from tests.server.conftest import API_KEY
from tests.server.survival import Baseline, assert_survived, baseline
from tests.server.test_fuzz import RawDealer

HUGE = 10**9
ANSWER_S = 30.0
"""Every refusal comes back within this (a generous bound on a loaded machine)."""
SMALL = {"max_new_tokens": 2, "temperature": 0}


@pytest.fixture
def before(rpc: Client) -> Iterator[Baseline]:
    taken = baseline(rpc)
    yield taken
    assert_survived(rpc, taken)


def refused(send: Any) -> str:
    """`send()` raises ServerError invalid_request in time; its message."""
    start = time.monotonic()
    with pytest.raises(ServerError) as err:
        send()
    assert time.monotonic() - start < ANSWER_S
    assert err.value.code == "invalid_request", err.value
    return err.value.message


def http_refused(http: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    start = time.monotonic()
    r = http.post(path, json=body)
    assert time.monotonic() - start < ANSWER_S
    assert r.status_code == 400, (path, r.status_code, r.text[:300])
    return r.json()["error"]


# (generate arguments, what the error names)
RPC_COUNTS = [
    (dict(sampling_params={**SMALL, "n": HUGE}), "sampling_params.n=1000000000 exceeds "
     "max_running_requests"),
    (dict(sampling_params={**SMALL, "beam_width": HUGE}), "sampling_params.beam_width"),
    (dict(sampling_params=SMALL, beam={"width": HUGE}), "beam.width"),
    (dict(sampling_params=SMALL, return_logprob=True, top_logprobs_num=HUGE),
     "max_top_logprobs_num"),
    (dict(sampling_params=SMALL, return_logprob=True, logprob_start_len=HUGE),
     "logprob_start_len"),
    (dict(sampling_params={**SMALL, "n": 100}, prompt=["hi"] * 50),
     "ask for 5000 outputs in all, more than max_queued_requests=4096 (--max-queued-requests)"),
]


class TestHugeCounts:
    @pytest.mark.parametrize("call,named", RPC_COUNTS)
    def test_rpc(self, rpc: Client, before: Baseline, call: dict[str, Any], named: str) -> None:
        message = refused(lambda: rpc.generate(**{"prompt": "hi", **call}))
        assert named in message, message

    def test_rpc_batches(self, rpc: Client, before: Baseline) -> None:
        message = refused(lambda: rpc.generate(prompt=[""] * (MAX_BATCH + 1),
                                               sampling_params=SMALL))
        assert "text" in message and str(MAX_BATCH) in message, message
        message = refused(lambda: rpc.generate(input_ids=[[1]] * (MAX_BATCH + 1),
                                               sampling_params=SMALL))
        assert f"more than the {MAX_BATCH} a call may pass" in message, message
        message = refused(lambda: rpc.generate(prompt=["hi"] * 4097, sampling_params=SMALL))
        assert "max_queued_requests" in message, message

    def test_generate_over_http(self, http: Any, before: Baseline) -> None:
        for body, named in [
                ({"sampling_params": {**SMALL, "n": HUGE}}, "max_running_requests"),
                ({"sampling_params": {**SMALL, "n": HUGE}, "stream": True},
                 "max_running_requests"),
                ({"sampling_params": [{**SMALL, "n": HUGE}], "text": ["hi"]},
                 "max_running_requests"),
                ({"sampling_params": {**SMALL, "beam_width": HUGE}}, "beam_width"),
                ({"return_logprob": True, "top_logprobs_num": HUGE}, "max_top_logprobs_num"),
                ({"return_logprob": True, "logprob_start_len": HUGE}, "logprob_start_len"),
                ({"text": [""] * (MAX_BATCH + 1)}, "text"),
                ({"text": None, "input_ids": [[1]] * (MAX_BATCH + 1)}, "input_ids")]:
            error = http_refused(http, "/generate", {"text": "hi", **body})
            assert named in error["message"] or error["param"] == named, (body, error)

    def test_openai_routes(self, http: Any, before: Baseline) -> None:
        completion = {"model": "smollm2-135m", "prompt": "hi", "max_tokens": 2}
        chat = {"model": "smollm2-135m", "max_tokens": 2,
                "messages": [{"role": "user", "content": "hi"}]}
        for path, body, param in [
                ("/v1/completions", {**completion, "n": HUGE}, "n"),
                ("/v1/completions", {**completion, "n": HUGE, "stream": True}, "n"),
                ("/v1/completions", {**completion, "best_of": HUGE}, "best_of"),
                ("/v1/completions", {**completion, "logprobs": HUGE}, "logprobs"),
                ("/v1/completions", {**completion, "prompt": ["hi"] * (MAX_BATCH + 1)},
                 "prompt"),
                ("/v1/chat/completions", {**chat, "n": HUGE}, "n"),
                ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": HUGE},
                 "top_logprobs")]:
            error = http_refused(http, path, body)
            assert error["param"] == param, (path, body.keys(), error)


# -- class 2: nesting -------------------------------------------------------------------

def nested(depth: int, kind: str = "array") -> bytes:
    """msgpack of `depth` arrays (or one-key maps) inside each other around a 1."""
    return (b"\x91" if kind == "array" else b"\x81\xa1k") * depth + b"\x01"


MARK = "\x00nested-here"


def frame(field: str, value: bytes, **call: Any) -> bytes:
    """A generate call whose `field` holds `value` (raw msgpack)."""
    fields = {"type": "generate", "call_id": 7, "text": "hi", "api_key": API_KEY, **call,
              field: MARK}
    return msgspec.msgpack.encode(fields).replace(msgspec.msgpack.encode(MARK), value)


def in_params(name: str, value: bytes) -> bytes:
    return b"\x81" + msgspec.msgpack.encode(name) + value


DEPTHS = (1000, 5000, 100_000)
"""Past the interpreter's recursion limit (~1000 frames), where msgspec raised
RecursionError; a shallower value in a field typed `Any` (custom_params) is valid."""


@pytest.fixture
def dealer(http_runtime: Any) -> Iterator[RawDealer]:
    d = RawDealer(http_runtime.rpc_address)
    yield d
    d.close()


class TestNesting:
    def test_rpc_frames_nested_in_every_field(self, dealer: RawDealer, before: Baseline
                                              ) -> None:
        frames = []
        for depth in DEPTHS:
            for kind in ("array", "map"):
                deep = nested(depth, kind)
                frames += [deep, frame("sampling_params", deep),
                           frame("sampling_params", in_params("custom_params", nested(
                               depth, "map"))),
                           frame("sampling_params", in_params("watermark", deep)),
                           frame("sampling_params", in_params("stop", deep)),
                           frame("sampling_params", b"\x91" + in_params("custom_params", deep)),
                           *(frame(name, deep) for name in (
                               "text", "input_ids", "rid", "beam", "api_key", "cache_salt",
                               "top_logprobs_num"))]
        for f in frames:
            start = time.monotonic()
            _, reply = dealer.answer(f)
            assert time.monotonic() - start < ANSWER_S
            assert isinstance(reply, ErrorReply), (f[:40], reply)
            assert reply.code in ("malformed_frame", "invalid_request"), reply
            assert reply.call_id in (7, -1), reply

    def test_http_bodies_nested(self, http: Any, before: Baseline) -> None:
        deep = "[" * 5000 + "]" * 5000
        for path, body in [
                ("/generate", '{"text": "hi", "sampling_params": %s}' % deep),
                ("/generate", '{"text": "hi", "sampling_params": {"custom_params": '
                              '{"a": %s}}}' % deep),
                ("/generate", '{"text": %s}' % deep),
                ("/v1/completions", '{"model": "smollm2-135m", "prompt": %s}' % deep),
                ("/v1/chat/completions", '{"model": "smollm2-135m", "messages": [], '
                 '"response_format": {"type": "json_schema", "json_schema": {"name": "x", '
                 '"schema": {"a": %s}}}}' % deep),
                ("/v1/chat/completions", '{"model": "smollm2-135m", "messages": [], '
                 '"chat_template_kwargs": {"a": %s}}' % ("[" * 70 + "]" * 70))]:
            r = http.post(path, content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (path, r.text[:300])
            assert "nests" in r.json()["error"]["message"], r.text[:300]

    def test_a_deep_json_schema_within_the_depth_limit_is_a_400_not_a_500(
            self, http: Any, before: Baseline) -> None:
        schema: dict[str, Any] = {"type": "string"}
        for _ in range(30):  # 60 levels of JSON: under the limit, deep for a schema check
            schema = {"type": "object", "properties": {"a": schema}}
        r = http.post("/v1/chat/completions", json={
            "model": "smollm2-135m", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}}})
        assert r.status_code in (200, 400), r.text[:300]

    def test_null_sampling_params_still_mean_the_default(self, rpc: Client, http: Any) -> None:
        """What SGLang's clients send (every unset setting as null) still decodes now that
        sampling_params are typed on the wire."""
        nulls = {"max_new_tokens": 2, "temperature": 0, "top_p": None, "top_k": None,
                 "stop": None, "n": None, "ignore_eos": None, "min_new_tokens": None}
        out = rpc.generate("hi", sampling_params=nulls)
        assert len(out["output_ids"]) <= 2
        r = http.post("/generate", json={"text": "hi", "sampling_params": nulls})
        assert r.status_code == 200 and r.json()["output_ids"] == out["output_ids"], r.text
