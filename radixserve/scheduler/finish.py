"""The last phase: a step's result folded in (`Folding`), whether a request is done
(`check_finish`), and the one place a sequence leaves the running batch, for good
(finished, aborted, failed, a beam the search dropped) or for a while (retracted), its KV
given back (`Finishing`).

Folding's contract:

- A sequence no longer running (aborted, retracted, finished while the step ran), or whose
  result a feature's `folded` hook dropped (overlap), is skipped.
- A prompt chunk's KV is cached as it is computed, so a request that shares the prefix
  can use it before this one finishes.
- A sampled token goes to its request's group (`SeqGroup.fold`), which decides what forks
  (samples, beams) and what the search drops; a verified speculative run is taken token by
  token as single steps would take it, a stop inside it ending the request there.
- A prompt computed to its end with nothing to sample (`max_new_tokens` 0) ends by length.

Finishing's contract:

- **Released once.** A sequence's blocks go back through `release` alone: cached (its
  computed prefix enters the tree) unless the step that computed it failed; the features'
  `releasing` hooks run first (overlap cuts the KV back to what folded steps computed).
- **A request ends with its last sequence**: it leaves `groups` then. Samples still to fork
  from a finished prompt end with it, for the same reason; a beam search ends whole.
- **Retracted is waiting, first in line**, its prefix cached, its input logprobs to be
  recomputed; the admission ratio goes back to its start (memory was short).
- **Every end answers**: the final `RequestUpdate`s are returned, unless a `finished` hook
  says the request's answer goes to nobody (a pin's prefill).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Collection

from radixserve.messages import ForwardResult, RequestUpdate, SeqOutput
from radixserve.scheduler.batch import ScheduledBatch
from radixserve.scheduler.cache_service import CacheService
from radixserve.scheduler.features import StepHooks
from radixserve.scheduler.request import Req, SeqGroup, Status
from radixserve.scheduler.state import SchedulerState
from radixserve.stop_strings import (SEARCH_SECONDS, Decode, PartialTimeout, SearchOverBudget,
                                     uncounted)

if TYPE_CHECKING:
    from radixserve.scheduler.speculation import Speculation

MATCHED_TEXT = {"skip_special_tokens": False, "spaces_between_special_tokens": True}
"""How the scheduler decodes the text it looks for stops in: special tokens kept (a stop
may name one), as SGLang matches them."""

ABORTED = {"type": "abort", "message": "aborted by the client"}

SETTLE_TOKENS = 4
"""Tokens at the end of the output whose text may still change (a character split across
tokens, spacing that depends on the next token): a search always re-reads them."""


def check_finish(req: Req, eos_ids: Collection[int],
                 decode: Decode | None) -> dict[str, Any] | None:
    """The finish reason after `req`'s newest token, or None to go on.

    Order as in SGLang: length, then stop token ids, then EOS, then stop strings and
    patterns; last, a constrained request whose output is complete (or broken). Until
    `min_new_tokens` are out no stop counts (the sampler keeps EOS and stop tokens out
    meanwhile); length and the constraint still end a request. Stops are looked for in the
    decoded output (see stop_strings.py).
    """
    sp = req.sampling
    out = req.output_ids
    if len(out) >= sp.max_new_tokens:
        return {"type": "length", "length": sp.max_new_tokens}
    if len(out) >= sp.min_new_tokens:
        token = out[-1]
        if sp.stop_token_ids and token in sp.stop_token_ids:
            return {"type": "stop", "matched": token}
        if not sp.ignore_eos and token in eos_ids:
            return {"type": "stop", "matched": token}
        stops, budget = req.stops, req.stop_budget
        if stops and budget is not None and decode is not None:
            began = time.perf_counter()
            try:
                found = _find_stop(req, decode)
            except SearchOverBudget as e:  # not searched: the output ends, not the step
                return {"type": "abort", "message": str(e)}
            if found is not None:
                return {"type": "stop", "matched": found}
            if stops.patterns:
                budget.search_left -= time.perf_counter() - began
                if budget.search_left <= 0:
                    return {"type": "abort", "message": "the stop_regex searches ran past "
                            f"their budget of {SEARCH_SECONDS:g}s per output: use fewer or "
                            "simpler patterns (or stop strings)"}
    if req.grammar is not None:
        if req.grammar.broken:
            return {"type": "abort", "message": "the sampled token breaks the output's "
                    f"constraint (sampling_params.{req.grammar.grammar.kind})"}
        if req.grammar.over_budget is not None:
            return {"type": "abort", "message": req.grammar.over_budget}
        if req.grammar.complete:  # the output cannot grow: done, nothing to trim
            return {"type": "stop", "matched": None}
    return None


def _find_stop(req: Req, decode: Decode) -> str | None:
    """The stop the newest token completed, if any, searched for only in the text the new
    tokens can change: stop strings in the last few tokens' text (`Stops.window`),
    patterns from `req.stop_from`, where a match may still begin, with one token before it
    as context for `^` and `\\b`. Linear in that text (RE2), and paid for before it runs:
    SearchOverBudget when the output's budget (`SearchBudget`) does not cover it."""
    # Special tokens stay in the text searched (as SGLang does), so a stop string such as
    # "<|im_start|>" stops generation whatever `skip_special_tokens` hides.
    out, stops, budget = req.output_ids, req.stops, req.stop_budget
    assert stops is not None and budget is not None  # (made together, for a request with stops)
    begin = max(0, req.stop_from - 1) if stops.patterns else len(out)
    start = min(stops.window(len(out)), begin)
    text = decode(out[start:], **MATCHED_TEXT)
    pos = len(decode(out[start:req.stop_from], **MATCHED_TEXT)) if req.stop_from > start else 0
    old = uncounted(req.sampling.min_new_tokens)
    after = len(decode(out[start:old], **MATCHED_TEXT)) if old > start else 0
    budget.new_step()
    found = stops.find(text, after, pos=pos, budget=budget)
    if found is not None:
        return found.matched
    if stops.patterns and budget.left > 0:
        try:
            if stops.resume_at(text, pos, after, budget) == len(text):
                req.stop_from = max(req.stop_from, len(out) - SETTLE_TOKENS)  # none under way
        except PartialTimeout:
            pass  # the budget is spent: searched from stop_from on, as it stands
    return None


class Finishing:
    def __init__(self, state: SchedulerState, cache: CacheService, hooks: StepHooks) -> None:
        self.state, self.cache, self.hooks = state, cache, hooks

    def finish(self, req: Req, reason: dict[str, Any], new_tokens: int) -> list[RequestUpdate]:
        """End `req` (and the samples still waiting to fork from it, for the same reason)
        and return their final updates (`req`'s with the step's `new_tokens` newest)."""
        req.finish_reason = reason
        self.remove(req, cache=True)
        self.state.counters["finished"] += 1
        if True in [hook(req, reason) for hook in self.hooks.finished]:
            return []
        updates = [req.update(new_tokens)]
        forks, req.group.unforked = req.group.unforked, []
        for fork in forks:
            fork.inherit_prompt(req)
            updates += self.finish(fork, reason, new_tokens=0)
        return updates

    def end(self, req: Req, reason: dict[str, Any]) -> list[RequestUpdate]:
        """End `req` without a new token: the whole request if it is a beam search."""
        if req.group.search is not None:
            return self.end_beams(req.group, reason)
        return self.finish(req, reason, new_tokens=0)

    def end_beams(self, group: SeqGroup, reason: dict[str, Any] | None) -> list[RequestUpdate]:
        """The search is over (`reason` None) or ended early: every output's answer."""
        updates = group.beam_results(reason)
        for b in list(group.beams):
            self.remove(b, cache=True)  # the final beams' pages may serve a follow-up
        self.state.counters["finished"] += len(updates)  # outputs (the beam width)
        return updates

    def remove(self, req: Req, cache: bool) -> None:
        """Take a sequence out for good, its KV released (cached first if `cache`); a
        request goes when its last sequence does."""
        state = self.state
        req.status = Status.FINISHED
        self.release(req, cache)
        if req in state.running:
            state.running.remove(req)
        elif req in state.waiting:
            state.waiting.remove(req)
        seqs = req.group.seqs
        seqs.remove(req)
        if not seqs:
            del state.groups[req.rid]

    def retract(self, req: Req) -> None:
        """Give back a running request's blocks (its computed prefix stays cached) and queue
        it first in line; it resumes by recomputing, usually from the cache."""
        state = self.state
        self.release(req, cache=True)
        state.running.remove(req)
        req.status = Status.WAITING
        req.forget_input_logprobs()
        state.waiting.insert(0, req)
        state.counters["retractions"] += 1
        state.new_token_ratio = state.config.init_new_token_ratio

    def release(self, req: Req, cache: bool) -> None:
        """Give back `req`'s KV, cached if `cache`."""
        for hook in self.hooks.releasing:
            hook(req)
        self.cache.kv.release(req.kv, req.tokens if cache else None)

    def abort(self, aborts: dict[str, dict[str, Any]]) -> list[RequestUpdate]:
        """End every output of the requests named in `aborts` (those still here), each
        for its finish reason."""
        updates = []
        for rid, reason in aborts.items():
            group = self.state.groups.get(rid)
            for req in list(group.seqs if group is not None else ()):
                if req.status is not Status.FINISHED:
                    updates += self.end(req, reason)
                    self.state.counters["aborted"] += 1
        return updates

    def fail(self, seqs: list[Req], message: str) -> list[RequestUpdate]:
        """The step that ran `seqs` failed: end each with an error, its KV uncached (the
        block copies planned for the step never ran, so those blocks hold nothing valid)."""
        for req in seqs:  # all first: a beam's end takes its siblings along, cached
            self.release(req, cache=False)
        updates = []
        for req in (r for r in seqs if r.status is Status.RUNNING):
            updates += self.end(req, {"type": "abort", "message": message})
        return updates


class Folding:
    def __init__(self, state: SchedulerState, cache: CacheService, finishing: Finishing,
                 eos_ids: frozenset[int], decode: Decode | None) -> None:
        self.state, self.cache, self.finishing = state, cache, finishing
        self.eos_ids, self.decode = eos_ids, decode
        self.spec: Speculation | None = None
        """Speculative decoding, once on: a step's drafts are its to keep or drop."""

    def fold(self, batch: ScheduledBatch, result: ForwardResult,
             dropped: set[int]) -> list[RequestUpdate]:
        """Advance each sequence of `batch` by `result` but those `dropped`; the updates."""
        counters = self.state.counters
        if (path := result.decode_graph) != "off":
            counters["graph_steps" if path == "replayed" else "eager_steps"] += 1
        if result.shared_runs:
            counters["cascade_steps"] += 1
            counters["cascade_shared_runs"] += result.shared_runs
        updates: list[RequestUpdate] = []
        for i, (seq, out) in enumerate(zip(batch.seqs, result.outputs)):
            req = seq.req
            if req.status is not Status.RUNNING or i in dropped:
                continue
            prefill, end = seq.start < len(req.input_ids), seq.start + seq.n
            if req.wants_input_logprobs:
                req.take_input_logprobs(out, end)
            counters["prefill_tokens" if prefill else "decode_tokens"] += seq.n
            if prefill:  # (a later step in flight may have computed more: not cached yet)
                self.cache.kv.cache_progress(req.kv, req.tokens, end)
            if seq.draft:
                updates += self._fold_run(req, out, len(seq.draft))
            elif seq.sample:
                updates += self._fold_token(req, out)
            elif end == req.seq_len and req.remaining_new_tokens <= 0:
                reason = {"type": "length", "length": req.sampling.max_new_tokens}
                updates += self.finishing.finish(req, reason, new_tokens=0)
        state = self.state
        state.new_token_ratio = max(state.config.min_new_token_ratio,
                                    state.new_token_ratio - state.config.new_token_ratio_decay)
        return updates

    def _fold_token(self, req: Req, out: SeqOutput) -> list[RequestUpdate]:
        """Carry out what `req`'s sampled row did to its request (`SeqGroup.fold`)."""
        group, fold = req.group, req.group.fold(req, out)
        for parent, child in fold.forks:
            self._place_fork(parent, child)
        if group.search is None:
            self.state.counters["forked_samples"] += len(fold.forks)
        for beam in fold.dropped:
            self.finishing.remove(beam, cache=False)  # no answer of its own
        if fold.search_over:
            return self.finishing.end_beams(group, None)
        updates = []
        for r in fold.sampled:
            reason = check_finish(r, self.eos_ids, self.decode)
            updates += [r.update(1)] if reason is None else self.finishing.finish(r, reason, 1)
        return updates

    def _fold_run(self, req: Req, out: SeqOutput, drafted: int) -> list[RequestUpdate]:
        """A speculative step of `req`: the kept run taken token by token."""
        assert self.spec is not None  # only a step it drafted has a draft
        run = self.spec.kept(req, out, drafted)
        self.state.counters["decode_tokens"] += len(run.tokens) - 1
        for j, token in enumerate(run.tokens):
            req.take_token(token, run.logprobs[j], run.tops[j])
            reason = check_finish(req, self.eos_ids, self.decode)
            if reason is not None:
                req.kv.kv_len = min(run.computed, req.seq_len)
                return self.finishing.finish(req, reason, new_tokens=j + 1)
        return [req.update(len(run.tokens))]

    def _place_fork(self, parent: Req, child: Req) -> None:
        """A new sequence forked from `parent` shares its KV and runs beside it; a parent
        that was retracted after its step has none to share, so its copy waits to recompute
        (mostly from the tree) as it does."""
        child.status = parent.status
        if parent.status is Status.RUNNING:
            self.cache.kv.fork(parent.kv, child.kv, parent.tokens)
            self.state.running.append(child)
        else:
            self.state.waiting.insert(0, child)
