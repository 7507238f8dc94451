"""The typed generate result and its SGLang dict shape (radixserve/results), without a model."""

from __future__ import annotations

import msgspec
import pytest

from radixserve.messages import ErrorReply, ResultReply, RpcReply
from radixserve.results.errors import HTTP_STATUS, ErrorCode, ServerError
from radixserve.results.generate import (Beam, CachedTokens, FinishReason, GenerateOutput,
                                        GenerateResult, Logprobs, TokenLogprob)
from radixserve.results.generate import sglang_result


def output(name: str, **fields) -> GenerateOutput:
    fields.setdefault("finish_reason", FinishReason("length", length=2))
    return GenerateOutput(id=name, text="hi", output_ids=[5, 6], prompt_tokens=3,
                          completion_tokens=2, cached_tokens=1,
                          cached_tokens_details=CachedTokens(memory=1), **fields)


def test_single_output_is_sglangs_dict() -> None:
    got = sglang_result(GenerateResult([output("r")], single=True))
    assert got == {"text": "hi", "output_ids": [5, 6], "meta_info": {
        "id": "r", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3,
        "completion_tokens": 2, "cached_tokens": 1,
        "cached_tokens_details": {"memory": 1, "disk": 0}, "e2e_latency": None,
        "ttft": None, "spec_draft_tokens": 0, "spec_accepted_tokens": 0}}


def test_finish_reasons_keep_their_sglang_keys() -> None:
    for reason, shape in [(FinishReason("stop", matched=2), {"type": "stop", "matched": 2}),
                          (FinishReason("stop"), {"type": "stop", "matched": None}),
                          (FinishReason("abort", message="x"), {"type": "abort", "message": "x"})]:
        got = sglang_result(GenerateResult([output("r", finish_reason=reason)], single=True))
        assert got["meta_info"]["finish_reason"] == shape


def test_batches_beams_and_logprobs() -> None:
    lp = Logprobs(output=[TokenLogprob(-0.5, 5, "h"), TokenLogprob(-1.0, 6, None)],
                  output_top=[[TokenLogprob(-0.5, 5, "h")], None],
                  input=[TokenLogprob(None, 1)], input_top=[None])
    flat = sglang_result(GenerateResult([output("a", logprobs=lp), output("b")]))
    assert [r["meta_info"]["id"] for r in flat] == ["a", "b"]
    meta = flat[0]["meta_info"]
    assert meta["output_token_logprobs"] == [[-0.5, 5, "h"], [-1.0, 6, None]]
    assert meta["output_top_logprobs"] == [[[-0.5, 5, "h"]], None]
    assert meta["input_token_logprobs"] == [[None, 1, None]]
    assert "output_token_logprobs" not in flat[1]["meta_info"]
    beams = GenerateResult([output(f"b{i}", beam_score=-i) for i in range(4)],
                           beams_per_prompt=[2, 2])
    grouped = sglang_result(beams)
    assert [[b["meta_info"]["beam_score"] for b in g] for g in grouped] == [[0, -1], [-2, -3]]
    one = output("r", beams=[Beam(text="hi", output_ids=[5], finish_reason=None,
                                  sequence_score=-0.1)], sequence_score=-0.1)
    meta = sglang_result(GenerateResult([one], single=True))["meta_info"]
    assert meta["sequence_score"] == -0.1
    assert meta["beam_results"] == [{"text": "hi", "output_ids": [5], "meta_info": {
        "finish_reason": None, "sequence_score": -0.1, "cumulative_logprob": None}}]


def test_results_and_errors_cross_the_wire_typed() -> None:
    decoder = msgspec.msgpack.Decoder(RpcReply)
    result = GenerateResult([output("r")], single=True).with_replica("tcp://x")
    back = decoder.decode(msgspec.msgpack.encode(ResultReply(1, result)))
    assert back.result == result and back.result.outputs[0].replica == "tcp://x"
    control = decoder.decode(msgspec.msgpack.encode(ResultReply(2, {"flushed": True})))
    assert control.result == {"flushed": True}
    error = decoder.decode(msgspec.msgpack.encode(ErrorReply(3, "unauthorized", "no key")))
    assert error.code is ErrorCode.UNAUTHORIZED


def test_shared_prompt_logprobs_cross_the_wire_once() -> None:
    """A prompt's samples share one list of prompt logprobs: the frame carries it once (the
    others name its output), and the decoded result shares it again; a result naming an
    output that carries none is refused."""
    prompt = [TokenLogprob(None, 1), TokenLogprob(-0.25, 2)]
    def sample(name: str) -> GenerateOutput:
        return output(name, logprobs=Logprobs(output=[], output_top=[], input=prompt,
                                              input_top=[None, None]))
    result = GenerateResult([sample("r:0"), sample("r:1"), sample("r:2")])
    decoder = msgspec.msgpack.Decoder(RpcReply)
    frame = msgspec.msgpack.encode(ResultReply(1, result.packed()))
    assert frame.count(msgspec.msgpack.encode(prompt)) == 1
    back = decoder.decode(frame).result.unpacked()
    assert back == result and back.outputs[2].logprobs.input is back.outputs[0].logprobs.input
    flat = sglang_result(back)
    assert all(r["meta_info"]["input_token_logprobs"] == [[None, 1, None], [-0.25, 2, None]]
               for r in flat)
    broken = GenerateResult([output("a", logprobs=Logprobs(output=[], output_top=[],
                                                           input_from=0))])
    with pytest.raises(ValueError, match="prompt logprobs name output 0"):
        decoder.decode(msgspec.msgpack.encode(ResultReply(1, broken))).result.unpacked()


def test_every_code_has_one_http_status() -> None:
    assert set(HTTP_STATUS) == set(ErrorCode)
    e = ServerError("unauthorized", "no key")
    assert e.code == "unauthorized" and e.http.status == 401 and str(e) == "[unauthorized] no key"
