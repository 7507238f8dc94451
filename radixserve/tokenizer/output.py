"""Collect a call's updates and render the SGLang-shaped result: one home for what the
Engine and the RPC front door both need to answer a generate (or beam search) call."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from radixserve.messages import RequestUpdate, SamplingParams, TokenizedRequest, TopLogprobs
from radixserve.rids import output_name
from radixserve.stop_strings import Stops, stop_decoder, trim, uncounted


@dataclass
class RequestState:
    """What the front door knows of one output of a request while it runs."""

    rid: str
    index: int = 0
    name: str = ""
    """The output's id in results: the rid, or `rid:index` when the request has several."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """How the output's text is decoded and trimmed."""
    stops: Stops = field(init=False)
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[TopLogprobs] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    input_top: list[TopLogprobs | None] | None = None
    input_ids: list[int] = field(default_factory=list)
    logprob_start_len: int = -1
    last: RequestUpdate | None = None
    created: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None

    def __post_init__(self) -> None:
        self.stops = Stops.of(self.sampling)  # patterns are compiled once per process

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished

    def apply(self, update: RequestUpdate) -> None:
        now = time.perf_counter()
        if update.new_token_ids and self.first_token_at is None:
            self.first_token_at = now
        if update.finished:
            self.finished_at = now
        self.output_ids.extend(update.new_token_ids)
        self.output_logprobs.extend(update.output_logprobs)
        self.output_top.extend(update.output_top)
        if update.input_logprobs is not None:
            self.input_logprobs = update.input_logprobs
            self.input_top = update.input_top
        self.last = update

    def text(self, tokenizer: Any) -> str:
        """The answer: the output decoded, then, as SGLang does, a stop token left out and
        the text cut before a stop string or pattern match (with `no_stop_trim`, both
        kept, and nothing after the match)."""
        sp = self.sampling
        decode = stop_decoder(tokenizer)
        reason = self.last.finish_reason if self.last else None
        matched = reason.get("matched") if reason else None
        ids = self.output_ids
        if type(matched) is int and ids and ids[-1] == matched and not sp.no_stop_trim:
            ids = ids[:-1]
        text = decode(ids, sp.skip_special_tokens, sp.spaces_between_special_tokens)
        if not isinstance(matched, str):
            return text
        old = ids[:uncounted(sp.min_new_tokens)]
        after = len(decode(old, sp.skip_special_tokens, sp.spaces_between_special_tokens))
        return trim(text, matched, self.stops, after, keep_stop=sp.no_stop_trim)

    def result(self, tokenizer: Any) -> dict[str, Any]:
        last = self.last
        meta: dict[str, Any] = {
            "id": self.name or self.rid,
            "finish_reason": last.finish_reason if last else None,
            "prompt_tokens": last.prompt_tokens if last else len(self.input_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": last.cached_tokens if last else 0,
            # By tier, SGLang's field name for its own tiers.
            "cached_tokens_details": {
                "memory": last.cached_tokens - last.disk_cached_tokens if last else 0,
                "disk": last.disk_cached_tokens if last else 0},
            "e2e_latency": _since(self.created, self.finished_at),
            "ttft": _since(self.created, self.first_token_at),
        }
        if last is not None and last.score is not None:
            meta["beam_score"] = last.score
            meta["cumulative_logprob"] = last.cumulative_logprob
        ignored = self.sampling.ignored_params()
        if ignored:
            meta["ignored_params"] = ignored
        if self.return_logprob:
            name = self._namer(tokenizer)
            meta["output_token_logprobs"] = [
                [lp, t, name(t)] for lp, t in zip(self.output_logprobs, self.output_ids)]
            meta["output_top_logprobs"] = [self._top(top, name) for top in self.output_top]
            if self.logprob_start_len >= 0:
                targets = self.input_ids[self.logprob_start_len:]
                meta["input_token_logprobs"] = [
                    [lp, t, name(t)] for lp, t in zip(self.input_logprobs or [], targets)]
                meta["input_top_logprobs"] = [self._top(top, name)
                                              for top in self.input_top or []]
        return {"text": self.text(tokenizer), "output_ids": list(self.output_ids),
                "meta_info": meta}

    def _namer(self, tokenizer: Any):
        if not self.return_text_in_logprobs:
            return lambda token_id: None
        return lambda token_id: tokenizer.decode([token_id])

    @staticmethod
    def _top(top: TopLogprobs | None, name) -> list[list[Any]] | None:
        if top is None:
            return None
        return [[lp, t, name(t)] for lp, t in zip(top.logprobs, top.token_ids)]


def _since(start: float, end: float | None) -> float | None:
    return None if end is None else end - start


@dataclass
class CallOutputs:
    """Every output of one call, in order: per request (prompt), its `num_outputs` outputs
    (samples or beams), each addressed by `(rid, index)` as the scheduler names it."""

    requests: list[TokenizedRequest]
    single: bool
    """The caller passed one prompt, not a list."""
    states: list[RequestState]
    _where: dict[tuple[str, int], int]
    names: list[str]
    """Each request's rid as its caller gave it (what results call it)."""
    error: str | None = None
    """Why the scheduler refused a request of the call after taking it (its constraint did
    not compile); the call then ends with this error."""

    @classmethod
    def of(cls, requests: list[TokenizedRequest], single: bool,
           return_text_in_logprobs: bool = False,
           names: list[str] | None = None) -> "CallOutputs":
        """`names`: the caller's rid of each request where the scheduler knows it by
        another (the front door scopes rids by tenant); by default the requests' own."""
        names = [req.rid for req in requests] if names is None else names
        states, where = [], {}
        for req, name in zip(requests, names, strict=True):
            count = req.num_outputs
            for i in range(count):
                where[(req.rid, i)] = len(states)
                states.append(RequestState(
                    rid=req.rid, index=i, name=output_name(name, i, count),
                    input_ids=req.input_ids, sampling=req.sampling,
                    return_logprob=req.return_logprob,
                    logprob_start_len=req.logprob_start_len,
                    return_text_in_logprobs=return_text_in_logprobs))
        return cls(requests, single, states, where, names)

    @property
    def rids(self) -> list[str]:
        return [req.rid for req in self.requests]

    @property
    def done(self) -> bool:
        return all(s.finished for s in self.states)

    def apply(self, update: RequestUpdate) -> int | None:
        """Fold `update` in; returns the position of the output it advanced (None if the
        update is not for this call)."""
        at = self._where.get((update.rid, update.index))
        if at is not None:
            self.states[at].apply(update)
        return at

    def result(self, tokenizer: Any) -> Any:
        """A dict for a single prompt with one output; else a flat list. For beam search
        (`beam=`) a list of beams (best first) per prompt, or one such list for one prompt;
        a prompt whose `sampling_params.beam_width` asked for them gets SGLang's one dict
        instead (see `sglang_beams`)."""
        results = [s.result(tokenizer) for s in self.states]
        grouped, at = [], 0
        for req in self.requests:
            grouped.append(results[at:at + req.num_outputs])
            at += req.num_outputs
        if any(req.beam is not None and not req.sampling.beam_search for req in self.requests):
            return grouped[0] if self.single else grouped
        flat = [one for req, name, outs in zip(self.requests, self.names, grouped)
                for one in ([sglang_beams(name, outs, req.sampling.n)]
                            if req.sampling.beam_search else outs)]
        return flat[0] if self.single and len(flat) == 1 else flat


def sglang_beams(rid: str, beams: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """SGLang's answer to a `beam_width` request: the best beam's text, ids and meta_info
    at the top, and its first `n` beams in `meta_info.beam_results`, best first, each with
    its `finish_reason` and `sequence_score`; `completion_tokens` counts them all."""
    kept = beams[:n]
    entries = [{"text": b["text"], "output_ids": b["output_ids"], "meta_info": {
        "finish_reason": b["meta_info"]["finish_reason"],
        "sequence_score": b["meta_info"].get("beam_score"),
        "cumulative_logprob": b["meta_info"].get("cumulative_logprob")}} for b in kept]
    best = kept[0]
    meta = {**best["meta_info"], "id": rid,
            "sequence_score": entries[0]["meta_info"]["sequence_score"],
            "completion_tokens": sum(len(b["output_ids"]) for b in kept),
            "beam_results": entries}
    return {"text": best["text"], "output_ids": best["output_ids"], "meta_info": meta}
