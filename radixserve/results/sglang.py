"""The one place a generate result becomes SGLang's `/generate` dict: `text`,
`output_ids`, `meta_info{id, finish_reason{type, ...}, prompt_tokens, completion_tokens,
cached_tokens, cached_tokens_details, e2e_latency, ttft, ...}`. The Engine, the RPC
clients and the HTTP `/generate` route all answer with it (docs/ and SGLang's frontend and
benchmark read it)."""

from __future__ import annotations

from typing import Any

import msgspec

from radixserve.results.generate import FinishReason, GenerateOutput, GenerateResult


def sglang_result(result: GenerateResult) -> dict[str, Any] | list[Any]:
    """A dict for a single output; else a flat list of them; for beam search a list of
    beams per prompt (one such list for one prompt)."""
    shared: dict[int, Any] = {}
    outputs = [sglang_output(out, shared) for out in result.outputs]
    if result.beams_per_prompt is not None:
        grouped, at = [], 0
        for count in result.beams_per_prompt:
            grouped.append(outputs[at:at + count])
            at += count
        return grouped[0] if result.single else grouped
    return outputs[0] if result.single else outputs


def finish_dict(reason: FinishReason | None) -> dict[str, Any] | None:
    """SGLang's finish_reason: `{"type": "stop", "matched"}`, `{"type": "length",
    "length"}` or `{"type": "abort", "message"}`."""
    if reason is None:
        return None
    if reason.type == "stop":
        return {"type": "stop", "matched": reason.matched}
    if reason.type == "length":
        return {"type": "length", "length": reason.length}
    return {"type": "abort", "message": reason.message}


def sglang_output(out: GenerateOutput, shared: dict[int, Any] | None = None) -> dict[str, Any]:
    """One output's dict. `shared`: the prompt logprobs already converted, by the id of
    their struct list, so a prompt's samples share one list (as their structs do)."""
    meta: dict[str, Any] = {
        "id": out.id, "finish_reason": finish_dict(out.finish_reason),
        "prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens,
        "cached_tokens_details": msgspec.to_builtins(out.cached_tokens_details),
        "e2e_latency": out.e2e_latency, "ttft": out.ttft,
        "spec_draft_tokens": out.spec_draft_tokens,
        "spec_accepted_tokens": out.spec_accepted_tokens}
    if out.beam_score is not None:
        meta["beam_score"] = out.beam_score
        meta["cumulative_logprob"] = out.cumulative_logprob
    if out.ignored_params:
        meta["ignored_params"] = list(out.ignored_params)
    lp = out.logprobs
    if lp is not None:
        meta["output_token_logprobs"] = msgspec.to_builtins(lp.output)
        meta["output_top_logprobs"] = msgspec.to_builtins(lp.output_top)
        if lp.input is not None:
            memo = {} if shared is None else shared
            if id(lp.input) not in memo:
                memo[id(lp.input)] = (msgspec.to_builtins(lp.input),
                                      msgspec.to_builtins(lp.input_top or []))
            meta["input_token_logprobs"], meta["input_top_logprobs"] = memo[id(lp.input)]
    if out.beams is not None:
        meta["sequence_score"] = out.sequence_score
        meta["beam_results"] = [
            {"text": b.text, "output_ids": list(b.output_ids), "meta_info": {
                "finish_reason": finish_dict(b.finish_reason),
                "sequence_score": b.sequence_score,
                "cumulative_logprob": b.cumulative_logprob}} for b in out.beams]
    if out.replica is not None:
        meta["replica"] = out.replica
    return {"text": out.text, "output_ids": list(out.output_ids), "meta_info": meta}
