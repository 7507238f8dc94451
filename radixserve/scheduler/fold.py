"""Folding a step's result in, the fourth phase: each sequence advanced by what the worker
computed and sampled, and ended when it is done (scheduler/finish.py).

The contract:

- A sequence no longer running (aborted, retracted, finished while the step ran), or whose
  result a feature's `folded` hook dropped (overlap), is skipped.
- A prompt chunk's KV is cached as it is computed, so a request that shares the prefix
  can use it before this one finishes.
- A sampled token goes to its request's group (`SeqGroup.fold`), which decides what forks
  (samples, beams) and what the search drops; a verified speculative run is taken token by
  token as single steps would take it, a stop inside it ending the request there.
- A prompt computed to its end with nothing to sample (`max_new_tokens` 0) ends by length.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.messages import ForwardResult, RequestUpdate, SeqOutput
from radixserve.scheduler.batch import ScheduledBatch
from radixserve.scheduler.cache_service import CacheService
from radixserve.scheduler.finish import Finishing, check_finish
from radixserve.scheduler.request import Req, Status
from radixserve.scheduler.state import SchedulerState
from radixserve.stop_strings import Decode

if TYPE_CHECKING:
    from radixserve.scheduler.speculation import Speculation


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
