"""A generate call's answer: as structs, what crosses the RPC socket and what the HTTP
routes read; and as SGLang's `/generate` dict, the one place a result becomes it
(`sglang_result`: `text`, `output_ids`, `meta_info{id, finish_reason{type, ...},
prompt_tokens, completion_tokens, cached_tokens, cached_tokens_details, e2e_latency, ttft,
...}`). The Engine, the RPC clients and the HTTP `/generate` route all answer with that
dict (docs/ and SGLang's frontend and benchmark read it)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct, structs


class FinishReason(Struct, omit_defaults=True, frozen=True):
    """Why an output ended: `stop` (on `matched`: a stop token's id, a stop string or
    pattern, or None when its constraint could not grow), `length` (`length`:
    max_new_tokens reached) or `abort` (`message` says why: the client aborted it, the
    constraint broke, the server ran out of memory...)."""

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None


class TokenLogprob(Struct, array_like=True, frozen=True):
    """One token's logprob, as SGLang's `[logprob, token_id, text]` triple; `text` is None
    unless the call asked for `return_text_in_logprobs`; `logprob` is None for a prompt's
    first token (nothing precedes it)."""

    logprob: float | None
    token_id: int
    text: str | None = None


TopLogprobs = list[TokenLogprob] | None
"""A position's most likely tokens, or None where none were asked or computed."""


class Logprobs(Struct, kw_only=True, omit_defaults=True):
    """The logprobs of an output that asked for them (`return_logprob`)."""

    output: list[TokenLogprob]
    output_top: list[TopLogprobs]
    input: list[TokenLogprob] | None = None
    """The prompt's, from `logprob_start_len`; None when it was -1 (not asked)."""
    input_top: list[TopLogprobs] | None = None
    input_from: Annotated[int, Meta(ge=0)] | None = None
    """On the wire only: `input` and `input_top` are those of the result's output at this
    earlier position (the same prompt's first), carried once (`GenerateResult.packed`)."""


class CachedTokens(Struct, frozen=True):
    """Of a prompt's cached tokens, those found in memory and those read back from disk."""

    memory: int = 0
    disk: int = 0


class Beam(Struct, kw_only=True):
    """One beam of an SGLang `beam_width` answer (`GenerateOutput.beams`)."""

    text: str
    output_ids: list[int]
    finish_reason: FinishReason | None
    sequence_score: float | None = None
    cumulative_logprob: float | None = None


class GenerateOutput(Struct, kw_only=True, omit_defaults=True):
    """One output of a generate call: a prompt's sample, or a beam."""

    id: str
    """The caller's rid, or `rid:index` when its prompt has several outputs."""
    text: str
    output_ids: list[int]
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_tokens_details: CachedTokens
    e2e_latency: float | None = None
    ttft: float | None = None
    beam_score: float | None = None
    """Beam search: the beam's length-normalised score (transformers' `sequences_scores`)."""
    cumulative_logprob: float | None = None
    ignored_params: list[str] = []
    """SGLang settings the request set that mean nothing here."""
    spec_draft_tokens: int = 0
    """Speculative decoding: tokens drafted for this output, and of them accepted."""
    spec_accepted_tokens: int = 0
    logprobs: Logprobs | None = None
    beams: list[Beam] | None = None
    """SGLang's `beam_width` answer: the first `n` beams, best first (this output is the
    best one's, its `completion_tokens` counting them all)."""
    sequence_score: float | None = None
    replica: str | None = None
    """Through a router: the replica that answered."""


class GenerateResult(Struct, tag="generate", array_like=True):
    """Every output of one generate call, in order: per prompt, its outputs.

    `single`: the caller passed one prompt with one output (the answer is that output, not
    a list). `beams_per_prompt`: a beam search call (`Engine.beam_search`), answered as a
    list of beams (best first) per prompt."""

    outputs: list[GenerateOutput]
    single: bool = False
    beams_per_prompt: list[int] | None = None

    def packed(self) -> GenerateResult:
        """This result for the wire: prompt logprobs that several outputs share (a prompt's
        samples show the same object) carried by the first only, the others naming it in
        `Logprobs.input_from`, so an `n`-sample call's frame holds them once."""
        first: dict[int, int] = {}
        outputs = []
        for i, out in enumerate(self.outputs):
            lp = out.logprobs
            if lp is not None and lp.input is not None:
                at = first.setdefault(id(lp.input), i)
                if at != i:
                    out = structs.replace(out, logprobs=structs.replace(
                        lp, input=None, input_top=None, input_from=at))
            outputs.append(out)
        return structs.replace(self, outputs=outputs)

    def unpacked(self) -> GenerateResult:
        """A decoded result with each output's prompt logprobs in place again (objects
        shared with the output that carried them): what `packed` took out."""
        for i, out in enumerate(self.outputs):
            lp = out.logprobs
            if lp is None or lp.input_from is None:
                continue
            source = self.outputs[lp.input_from].logprobs if lp.input_from < i else None
            if source is None or source.input is None:
                raise ValueError(f"output {i}'s prompt logprobs name output {lp.input_from}, "
                                 "which carries none before it")
            lp.input, lp.input_top, lp.input_from = source.input, source.input_top, None
        return self

    def with_replica(self, url: str) -> GenerateResult:
        """This result, each output marked as answered by the replica at `url` (a router's
        relay: the result was just decoded and is not shared)."""
        for out in self.outputs:
            out.replica = url
        return self


# -- SGLang's dict ----------------------------------------------------------------------
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
