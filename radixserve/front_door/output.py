"""Collect a call's updates and render its typed result (`results.generate`): one home for
what the Engine and the RPC front door both need to answer a generate (or beam search)
call."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec

from radixserve.messages import (GenerateCall, RequestUpdate, SamplingParams, TokenizedRequest,
                                 TopLogprobs)
from radixserve.rids import output_name
from radixserve.results.generate import (Beam, CachedTokens, FinishReason, GenerateOutput,
                                        GenerateResult, Logprobs, TokenLogprob)
from radixserve.stop_strings import Decode, Stops, trim, uncounted
from radixserve.front_door.detokenizer import StreamedText


@dataclass(eq=False)
class PromptLogprobs:
    """A request's prompt logprobs (from `logprob_start_len`), one object shared by all its
    outputs: the scheduler sends them once, with its first output's update, and they are
    rendered once however many samples show them."""

    targets: list[int]
    """The prompt tokens they score."""
    logprobs: list[float | None] = field(default_factory=list)
    top: list[TopLogprobs | None] = field(default_factory=list)
    _rendered: tuple[list[TokenLogprob], list[list[TokenLogprob] | None]] | None = None

    def take(self, update: RequestUpdate) -> None:
        if update.input_logprobs is not None:
            self.logprobs, self.top = update.input_logprobs, update.input_top or []
            self._rendered = None

    def rendered(self, name: Callable[[int], str | None]
                 ) -> tuple[list[TokenLogprob], list[list[TokenLogprob] | None]]:
        if self._rendered is None:
            self._rendered = ([TokenLogprob(lp, t, name(t))
                               for lp, t in zip(self.logprobs, self.targets)],
                              [_top(top, name) for top in self.top])
        return self._rendered


@dataclass
class RequestState:
    """What the front door knows of one output of a request while it runs."""

    rid: str
    index: int = 0
    name: str = ""
    """The output's id in results: the rid, or `rid:index` when the request has several."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """How the output's text is decoded and trimmed."""
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    """Shared by the request's outputs; None when not asked (`logprob_start_len` -1)."""
    input_ids: list[int] = field(default_factory=list)
    last: RequestUpdate | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    """The scheduler's finish reason (a dict on its side of the wire), once finished."""
    created: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None

    def apply(self, update: RequestUpdate) -> None:
        now = time.perf_counter()
        if update.new_token_ids and self.first_token_at is None:
            self.first_token_at = now
        if update.finish_reason is not None:
            self.finished, self.finished_at = True, now
            self.finish_reason = msgspec.convert(update.finish_reason, FinishReason)
        self.output_ids.extend(update.new_token_ids)
        self.output_logprobs.extend(update.output_logprobs)
        self.output_top.extend(update.output_top)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs.take(update)
        self.last = update

    def text(self, tokenizer: Any) -> str:
        """The answer: the output decoded, then, as SGLang does, a stop token left out and
        the text cut before a stop string or pattern match (with `no_stop_trim`, both
        kept, and nothing after the match)."""
        sp = self.sampling
        decode: Decode = tokenizer.decode
        matched = self.finish_reason.matched if self.finish_reason else None
        ids = self.output_ids
        if type(matched) is int and ids and ids[-1] == matched and not sp.no_stop_trim:
            ids = ids[:-1]
        text = decode(ids, skip_special_tokens=sp.skip_special_tokens,
                      spaces_between_special_tokens=sp.spaces_between_special_tokens)
        if not isinstance(matched, str):
            return text
        old = ids[:uncounted(sp.min_new_tokens)]
        after = len(decode(old, skip_special_tokens=sp.skip_special_tokens,
                           spaces_between_special_tokens=sp.spaces_between_special_tokens))
        # Stops.of compiles the patterns once per process.
        return trim(text, matched, Stops.of(sp), after, keep_stop=sp.no_stop_trim)

    def result(self, tokenizer: Any) -> GenerateOutput:
        last, created = self.last, self.created
        cached = last.cached_tokens if last else 0
        disk = last.disk_cached_tokens if last else 0
        return GenerateOutput(
            id=self.name or self.rid, text=self.text(tokenizer),
            output_ids=list(self.output_ids), finish_reason=self.finish_reason,
            prompt_tokens=last.prompt_tokens if last else len(self.input_ids),
            completion_tokens=len(self.output_ids), cached_tokens=cached,
            cached_tokens_details=CachedTokens(memory=cached - disk, disk=disk),
            e2e_latency=None if self.finished_at is None else self.finished_at - created,
            ttft=None if self.first_token_at is None else self.first_token_at - created,
            beam_score=last.score if last else None,
            cumulative_logprob=last.cumulative_logprob if last and last.score is not None
            else None,
            ignored_params=self.sampling.ignored_params(),
            spec_draft_tokens=last.spec_draft_tokens if last else 0,
            spec_accepted_tokens=last.spec_accepted_tokens if last else 0,
            logprobs=self._logprobs(tokenizer) if self.return_logprob else None)

    def _logprobs(self, tokenizer: Any) -> Logprobs:
        name = self._namer(tokenizer)
        out = Logprobs(output=[TokenLogprob(lp, t, name(t)) for lp, t
                               in zip(self.output_logprobs, self.output_ids)],
                       output_top=[_top(top, name) for top in self.output_top])
        if self.prompt_logprobs is not None:
            out.input, out.input_top = self.prompt_logprobs.rendered(name)
        return out

    def _namer(self, tokenizer: Any) -> Callable[[int], str | None]:
        if not self.return_text_in_logprobs:
            return lambda token_id: None
        return lambda token_id: tokenizer.decode([token_id])


def _top(top: TopLogprobs | None, name: Callable[[int], str | None]
         ) -> list[TokenLogprob] | None:
    if top is None:
        return None
    return [TokenLogprob(lp, t, name(t)) for lp, t in zip(top.logprobs, top.token_ids)]


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
    done: bool = False
    """Every output has finished."""

    @classmethod
    def of(cls, requests: list[TokenizedRequest], single: bool,
           return_text_in_logprobs: bool = False,
           names: list[str] | None = None) -> CallOutputs:
        """`names`: the caller's rid of each request where the scheduler knows it by
        another (the front door scopes rids by tenant); by default the requests' own."""
        names = [req.rid for req in requests] if names is None else names
        states: list[RequestState] = []
        where: dict[tuple[str, int], int] = {}
        for req, name in zip(requests, names, strict=True):
            count = req.num_outputs
            prompt = (PromptLogprobs(req.input_ids[req.logprob_start_len:])
                      if req.return_logprob and req.logprob_start_len >= 0 else None)
            for i in range(count):
                where[(req.rid, i)] = len(states)
                states.append(RequestState(
                    rid=req.rid, index=i, name=output_name(name, i, count),
                    input_ids=req.input_ids, sampling=req.sampling,
                    return_logprob=req.return_logprob, prompt_logprobs=prompt,
                    return_text_in_logprobs=return_text_in_logprobs))
        return cls(requests, single, states, where, names)

    def apply(self, update: RequestUpdate) -> int | None:
        """Fold `update` in; returns the position of the output it advanced (None if the
        update is not for this call)."""
        at = self._where.get((update.rid, update.index))
        if at is not None:
            self.states[at].apply(update)
            if update.finish_reason is not None:  # the call may be done now
                self.done = all([s.finished for s in self.states])
        return at

    def result(self, tokenizer: Any) -> GenerateResult:
        """Every output in order (`generate.sglang_result` shapes it for the caller): for a
        beam search call (`beam=`) the beams of each prompt, best first; a prompt whose
        `sampling_params.beam_width` asked for them gives SGLang's one output instead (see
        `sglang_beams`)."""
        results = [s.result(tokenizer) for s in self.states]
        grouped, at = [], 0
        for req in self.requests:
            grouped.append(results[at:at + req.num_outputs])
            at += req.num_outputs
        if any([req.beam is not None and not req.sampling.beam_search
                for req in self.requests]):
            return GenerateResult(results, self.single,
                                  beams_per_prompt=[len(beams) for beams in grouped])
        flat = [one for req, name, outs in zip(self.requests, self.names, grouped)
                for one in ([sglang_beams(name, outs, req.sampling.n)]
                            if req.sampling.beam_search else outs)]
        return GenerateResult(flat, self.single and len(flat) == 1)


def sglang_beams(rid: str, beams: list[GenerateOutput], n: int) -> GenerateOutput:
    """SGLang's answer to a `beam_width` request: the best beam's output, and its first
    `n` beams in `beams`, best first, each with its finish reason and `sequence_score`;
    `completion_tokens` counts them all."""
    kept = beams[:n]
    best = kept[0]
    return msgspec.structs.replace(
        best, id=rid, sequence_score=best.beam_score,
        completion_tokens=sum(len(b.output_ids) for b in kept),
        beams=[Beam(text=b.text, output_ids=b.output_ids, finish_reason=b.finish_reason,
                    sequence_score=b.beam_score, cumulative_logprob=b.cumulative_logprob)
               for b in kept])


@dataclass
class Call:
    """One client's generate call: its outputs, and where and how they go back."""

    peer: Any
    """Where its replies go (the front door's `Peer`)."""
    call_id: int
    stream: bool
    outputs: CallOutputs
    streamed: StreamedText | None = None
    """The chunks' text, when the call streams."""

    @classmethod
    def of(cls, peer: Any, call: GenerateCall, requests: list[TokenizedRequest], single: bool,
           names: list[str], tokenizer: Any) -> Call:
        """The state of `call` once its `requests` (named `names` by the caller) are sent."""
        entry = cls(peer, call.call_id, call.stream,
                    CallOutputs.of(requests, single, call.return_text_in_logprobs, names))
        if call.stream:
            entry.streamed = StreamedText(tokenizer, requests)
        return entry
