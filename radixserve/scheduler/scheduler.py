"""The scheduler: which tokens run in the next step, and where their KV goes.

Its policy and its step: requests in (`add_request`), `schedule` (one batch for the
worker: running decodes, with their drafts, and prefill chunks first, then admissions),
`process_result` (the worker's sampled tokens folded back in), retraction, aborts and finishing. No
sockets, no torch. The rest it composes:

- every cache matter (tree, block pool, KV manager, pins, disk index, the router's view) is
  the `CacheService` (scheduler/cache_service.py), `self.cache`;
- a request's outputs, parallel samples and beams alike, are its `SeqGroup`
  (scheduler/request.py), which decides what forks and what ends;
- output constraints compile off this loop (scheduler/grammar_compiler.py);
- which waiting requests join is `Admission` (scheduler/admission.py);
- speculative decoding's drafts and verified runs are `Speculation` (scheduler/speculation.py);
- with overlap scheduling, the steps in flight are `RunAhead`'s (scheduler/overlap.py);
- LoRA adapters and their device slots are `LoraRegistry`'s (scheduler/loras.py).
"""

from __future__ import annotations

import random
import time
from typing import Any

from radixserve.config import EngineConfig
from radixserve.messages import (Control, ControlReply, ForwardBatch, ForwardResult,
                                 RequestUpdate, SeqOutput, TokenizedRequest, WorkerInfo)
from radixserve.scheduler.admission import Admission
from radixserve.scheduler.batch import ScheduledBatch, ScheduledSeq, build_forward_batch, plan_seq
from radixserve.scheduler.cache_service import CacheService
from radixserve.scheduler.constraints import ConstraintWaits
from radixserve.scheduler.loras import LoraRegistry
from radixserve.scheduler.grammar import Grammar
from radixserve.scheduler.grammar_compiler import Compile, CompilerBusy, GrammarCompiler
from radixserve.scheduler.mappings import MappingAccount, mapping_stats
from radixserve.scheduler.overlap import RunAhead
from radixserve.scheduler.request import Req, SeqGroup, Status
from radixserve.scheduler.shares import TenantShares
from radixserve.scheduler.speculation import Speculation
from radixserve.scheduler.stop import check_finish
from radixserve.scheduler.worker_rows import WorkerRows
from radixserve.stop_strings import Decode


class OverloadedError(RuntimeError):
    """The waiting queue is full; the request was not queued."""


class Scheduler:
    def __init__(self, config: EngineConfig, info: WorkerInfo, decode: Decode | None = None,
                 eos_token_ids: list[int] | None = None, cache_events: bool = False,
                 cache_secret: bytes = b"", overlap: bool | None = None) -> None:
        """`cache_events`: record the tree's changes for `cache.take_cache_events`, which must
        then be called after every step (what it has not taken accumulates). `cache_secret`
        keys the tree's page hashes (tenants.load_cache_secret). `overlap`: see `RunAhead.of`."""
        self.config, self.info, self.decode = config, info, decode
        self.page_size = info.page_size
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.cache = CacheService(config, info, self.waiting, self.running, cache_events,
                                  cache_secret)
        self.eos_ids = frozenset(info.eos_token_ids) | frozenset(eos_token_ids or ())
        self.grammars = GrammarCompiler(info.model_path, info.vocab_size, sorted(self.eos_ids),
                                        config.max_grammar_compile_seconds,
                                        config.grammar_compile_threads,
                                        config.max_pending_grammar_compiles,
                                        config.max_grammar_compiles_per_tenant)
        """Output constraints (regex, JSON schema, ...), compiled off this loop, cached."""
        self.constraints = ConstraintWaits(self.grammars)
        self.maps = MappingAccount.for_budget(info.kv_mapping_budget)  # virtual layout's VMAs
        self.spec = Speculation(config, self.cache.index, self.cache.kv, self.maps)
        self.shares = TenantShares(config)
        self.loras = LoraRegistry(config, info.loras)  # adapters, and their device slots
        self.admission = Admission(config, self.cache, self.maps, self.shares, self.loras,
                                   self.waiting, self.running)
        self.overlap = RunAhead.of(config, info, self.cache.kv, overlap)  # steps in flight
        self.worker_rows = WorkerRows.of(info, self.loras, self.overlap is not None)
        self.groups: dict[str, SeqGroup] = {}  # each unfinished request's outputs, by rid
        self.new_token_ratio = config.init_new_token_ratio
        self._rng = random.Random(config.seed)
        self._aborts: list[str] = []
        self.counters = dict(steps=0, prefill_tokens=0, decode_tokens=0, retractions=0,
                             finished=0, aborted=0, cascade_steps=0, cascade_shared_runs=0,
                             forked_samples=0, graph_steps=0, eager_steps=0)
        self.scheduler_seconds = 0.0
        """Time spent in schedule() and process_result(): the scheduler's own overhead."""

    # -- requests in ------------------------------------------------------------------
    def add_request(self, request: TokenizedRequest) -> None:
        """Queue a request (validated at the edge, tokenizer/requests.py) as sequences
        `(rid, index)` (samples after the first fork from it once it has the prompt). Raises
        ValueError (it can never run here: e.g. an unknown adapter), OverloadedError (queue
        or grammar compiler full). One whose constraint is compiling waits outside the
        queue (`self.constraints`), refused by `constraints.take_rejections` if it fails."""
        if request.rid in self.groups:
            raise ValueError(f"rid {request.rid!r} is already in use")
        request = self.loras.bind(request)  # its adapter's namespace, or ValueError
        if request.rid in self._aborts:  # meant for an earlier request of that rid
            self._aborts = [rid for rid in self._aborts if rid != request.rid]
        queued = sum(r.group.queued_width for r in self.waiting)  # samples and beams count
        if queued + request.num_outputs > self.config.max_queued_requests:
            raise OverloadedError(
                f"server overloaded: {queued} requests waiting "
                f"(max_queued_requests={self.config.max_queued_requests})")
        refusal = self.shares.queue_refusal(request.tenant, self.waiting, request.num_outputs)
        if refusal is not None:
            raise OverloadedError(refusal)
        try:
            constraint = self.constraints.lookup(request)
        except CompilerBusy as e:
            raise OverloadedError(str(e)) from None
        grammar = constraint if isinstance(constraint, Grammar) else None
        group = self.groups[request.rid] = SeqGroup.of(request, self._rng, grammar, self.eos_ids)
        if isinstance(constraint, Compile):
            self.constraints.wait(group, constraint)
        else:
            self.waiting.append(group.leader)

    def abort(self, rid: str) -> None:
        """Abort every output of the request `rid` at the start of the next step."""
        self._aborts.append(rid)

    def pin(self, msg: Control, prefill: TokenizedRequest) -> ControlReply | None:
        """Pin `prefill`'s prefix (a `PinCall` in `msg`; see scheduler/cache_service.py):
        the answer now, or None when it comes from `cache.take_control_replies` once
        `prefill` has computed the prefix (it was not cached whole)."""
        reply = self.cache.pin(msg, prefill)
        if reply is None:
            try:
                self.add_request(prefill)
                self.cache.pin_after_prefill(msg, prefill)
            except (ValueError, OverloadedError) as e:
                reply = ControlReply(msg.call_id, {}, error=str(e))
        return reply

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborts)

    # -- one step ---------------------------------------------------------------------
    def schedule(self) -> tuple[ScheduledBatch | None, list[RequestUpdate]]:
        """The next step (None when idle), and the updates of requests aborted unrun."""
        start = time.perf_counter()
        kv = self.cache.kv
        self.cache.pins.expire()
        updates = self._apply_aborts()
        self.waiting.extend(group.leader for group in self.constraints.take_ready(self.groups))
        seqs: list[ScheduledSeq] = []
        while not seqs and (self.running or self.waiting):
            seqs = self._pick()
            if seqs or kv.loads or self.overlap and self.overlap.in_flight:
                break  # (with a step in flight, its fold may free what is short)
            # Nothing could run for memory (every running request stuck mid-prefill, or a
            # beam waiting for its siblings' candidates, or the queue's head not fitting
            # beside the prefixes held for the others): a held prefix goes first (it costs
            # only a load to bring back), then the newest running request.
            if kv.held:
                kv.drop_holds()
            elif self.running:
                self._retract(self.running[-1])
            else:
                break
        self.scheduler_seconds += time.perf_counter() - start
        self.cache.note_usage()
        if not seqs and not self.cache.has_transfers:
            return None, updates
        self.counters["steps"] += 1
        forward = build_forward_batch(seqs, self.worker_rows, self.running, kv.take_copies(),
                                      self.eos_ids)
        self.cache.send_transfers(forward)
        batch = ScheduledBatch(seqs, forward, kv.take_loads())
        if self.overlap is not None:
            self.overlap.launched(batch)
        return batch, updates

    def _pick(self) -> list[ScheduledSeq]:
        if (victim := self.shares.preemption_victim(self.waiting, self.running)) is not None:
            self._retract(victim)  # a waiting tenant under its share takes its place
        budget = self.config.chunked_prefill_size
        kv = self.cache.kv
        decodes = [r for r in self.running if r.to_compute == 1]
        while ((need := kv.blocks_for((r.kv for r in decodes), 1)) > kv.available_blocks
               or self.maps and not self.maps.fits(self.running, need)):  # one more mapping
            if kv.held and need > kv.available_blocks:  # a held prefix before any request
                kv.drop_holds()
            elif self.overlap and self.overlap.in_flight:  # its fold first: retract nothing
                decodes.pop()  # (so no step in flight is lost to a retraction)
            else:
                self._retract(victim := self.running[-1])
                if victim in decodes:
                    decodes.remove(victim)
        seqs = []
        for req in decodes:
            kv.grow(req.kv, 1)
            seqs.append(plan_seq(req, 1))
            budget -= 1
        budget -= self.spec.draft(seqs, budget, self.running)
        for req in self.running:
            n = min(req.to_compute, budget)
            if req.to_compute > 1 and n > 0 and (not self.maps or self.maps.grows(
                    self.running, req, kv.blocks_for([req.kv], n))):
                n = kv.grow(req.kv, n)
                if n:
                    seqs.append(plan_seq(req, n))
                    budget -= n
        if budget > 0:
            seqs.extend(self.admission.admit(budget, self.new_token_ratio))
        return seqs

    def process_result(self, batch: ScheduledBatch, result: ForwardResult) -> list[RequestUpdate]:
        """Advance each sequence of `batch` by the worker's result; finish those that are done."""
        start = time.perf_counter()
        updates: list[RequestUpdate] = []
        self.cache.kv.finish_loads(batch.loads, result.kv_failed)
        if self.maps:
            self.maps.in_use = result.kv_mappings
        self.spec.observe(batch.seqs, result.forward_seconds)
        if (path := result.decode_graph) != "off":
            self.counters["graph_steps" if path == "replayed" else "eager_steps"] += 1
        if result.shared_runs:
            self.counters["cascade_steps"] += 1
            self.counters["cascade_shared_runs"] += result.shared_runs
        dropped = self.overlap.fold(batch) if self.overlap is not None else ()
        for i, (seq, out) in enumerate(zip(batch.seqs, result.outputs)):
            req = seq.req
            if req.status is not Status.RUNNING or i in dropped:
                continue  # aborted, retracted or finished while the step ran
            prefill, end = seq.start < len(req.input_ids), seq.start + seq.n
            req.take_input_logprobs(out, end)
            self.counters["prefill_tokens" if prefill else "decode_tokens"] += seq.n
            if prefill:  # (a later step in flight may have computed more: not cached yet)
                self.cache.kv.cache_progress(req.kv, req.tokens, end)
            if seq.draft:
                updates += self._fold_run(req, out, len(seq.draft))
            elif seq.sample:
                updates += self._fold(req, out)
            elif end == req.seq_len and req.remaining_new_tokens <= 0:
                reason = {"type": "length", "length": req.sampling.max_new_tokens}
                updates += self._finish(req, reason, new_tokens=0)
        self.new_token_ratio = max(self.config.min_new_token_ratio,
                                   self.new_token_ratio - self.config.new_token_ratio_decay)
        if self.config.debug_invariants:
            self.check_invariants()
        self.scheduler_seconds += time.perf_counter() - start
        return updates

    def _fold(self, req: Req, out: SeqOutput) -> list[RequestUpdate]:
        """Carry out what `req`'s sampled row did to its request (`SeqGroup.fold`)."""
        group, fold = req.group, req.group.fold(req, out)
        for parent, child in fold.forks:
            self._place_fork(parent, child)
        if group.search is None:
            self.counters["forked_samples"] += len(fold.forks)
        for beam in fold.dropped:
            self._remove(beam, cache=False)  # no answer of its own
        if fold.search_over:
            return self._end_beams(group, None)
        updates = []
        for r in fold.sampled:
            reason = check_finish(r, self.eos_ids, self.decode)
            updates += [r.update(1)] if reason is None else self._finish(r, reason, 1)
        return updates

    def _fold_run(self, req: Req, out: SeqOutput, drafted: int) -> list[RequestUpdate]:
        """A speculative step of `req`: the kept run taken token by token, as single steps
        would take it (a stop inside it ends the request there, the rest dropped)."""
        run = self.spec.kept(req, out, drafted)
        self.counters["decode_tokens"] += len(run.tokens) - 1
        for j, token in enumerate(run.tokens):
            req.take_token(token, run.logprobs[j], run.tops[j])
            reason = check_finish(req, self.eos_ids, self.decode)
            if reason is not None:
                req.kv.kv_len = min(run.computed, req.seq_len)
                return self._finish(req, reason, new_tokens=j + 1)
        return [req.update(len(run.tokens))]

    def _place_fork(self, parent: Req, child: Req) -> None:
        """A new sequence forked from `parent` shares its KV and runs beside it; a parent
        that was retracted after its step has none to share, so its copy waits to recompute
        (mostly from the tree) as it does."""
        child.status = parent.status
        if parent.status is Status.RUNNING:
            self.cache.kv.fork(parent.kv, child.kv, parent.tokens)
            self.running.append(child)
        else:
            self.waiting.insert(0, child)

    def fail_batch(self, batch: ScheduledBatch, message: str) -> list[RequestUpdate]:
        """The worker could not run `batch`: end its requests with an error, keep serving.
        Their KV goes uncached: the block copies planned for this step (a kept partial
        block, a copy-on-write tail) never ran, so those blocks hold no valid tokens."""
        updates = []
        self.worker_rows.forget_all()
        self.cache.kv.finish_loads(batch.loads, None)
        dropped = self.overlap.fold(batch) if self.overlap is not None else ()
        failed = [s.req for i, s in enumerate(batch.seqs) if i not in dropped]
        for req in failed:  # all first: a beam's end takes its siblings along, cached
            self._release(req, cache=False)
        for req in (r for r in failed if r.status is Status.RUNNING):
            updates += self._end(req, {"type": "abort", "message": message})
        return updates

    # -- lifecycle --------------------------------------------------------------------
    def _end(self, req: Req, reason: dict[str, Any]) -> list[RequestUpdate]:
        """End `req` without a new token: the whole request if it is a beam search."""
        if req.group.search is not None:
            return self._end_beams(req.group, reason)
        return self._finish(req, reason, new_tokens=0)

    def _finish(self, req: Req, reason: dict[str, Any], new_tokens: int) -> list[RequestUpdate]:
        """End `req` (and the samples still waiting to fork from it, for the same reason)
        and return their final updates (`req`'s with the step's `new_tokens` newest)."""
        req.finish_reason = reason
        self._remove(req, cache=True)
        self.counters["finished"] += 1
        if self.cache.prefilled(req.rid, reason):  # a pin's prefix: pinned before any step
            return []
        updates = [req.update(new_tokens)]
        forks, req.group.unforked = req.group.unforked, []
        for fork in forks:
            fork.inherit_prompt(req)
            updates += self._finish(fork, reason, new_tokens=0)
        return updates

    def _end_beams(self, group: SeqGroup, reason: dict[str, Any] | None) -> list[RequestUpdate]:
        """The search is over (`reason` None) or ended early: every output's answer."""
        updates = group.beam_results(reason)
        for b in list(group.beams):
            self._remove(b, cache=True)  # the final beams' pages may serve a follow-up
        self.counters["finished"] += len(updates)  # outputs (the beam width), as for samples
        return updates

    def _remove(self, req: Req, cache: bool) -> None:
        """Take a sequence out of the scheduler for good, its KV released (cached first if
        `cache`); a request goes when its last sequence does."""
        req.status = Status.FINISHED
        self._release(req, cache)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        seqs = req.group.seqs
        seqs.remove(req)
        if not seqs:
            del self.groups[req.rid]

    def _retract(self, req: Req) -> None:
        """Give back a running request's blocks (its computed prefix stays cached) and queue
        it first in line; it resumes by recomputing, usually from the cache."""
        self._release(req, cache=True)
        self.running.remove(req)
        req.status = Status.WAITING
        req.forget_input_logprobs()
        self.waiting.insert(0, req)
        self.counters["retractions"] += 1
        self.new_token_ratio = self.config.init_new_token_ratio

    def _release(self, req: Req, cache: bool) -> None:
        """Give back `req`'s KV, cached if `cache` (what folded steps computed: `settle`)."""
        if self.overlap is not None:
            self.overlap.settle(req)
        self.cache.kv.release(req.kv, req.tokens if cache else None)

    def _apply_aborts(self) -> list[RequestUpdate]:
        updates = []
        for rid in self._aborts:
            group = self.groups.get(rid)
            for req in list(group.seqs if group is not None else ()):
                if req.status is not Status.FINISHED:
                    updates += self._end(req, {"type": "abort", "message": "aborted by the client"})
                    self.counters["aborted"] += 1
        self._aborts.clear()
        return updates

    def flush_cache(self) -> bool:
        """Drop every cached prefix but the pinned ones (see `RadixCache.flush`); refused
        (False) while requests are queued or running."""
        if self.running or self.waiting:
            return False
        self.cache.flush()
        return True

    def close(self) -> ForwardBatch | None:
        """Stop serving: abort every request and with a disk tier write the cached prefixes
        to it (`CacheService.close`: the worker's last step; then `cache.save_index`)."""
        if not self.cache.has_disk:
            return None
        self._aborts.extend(self.groups)
        self._apply_aborts()
        return self.cache.close()

    def stats(self) -> dict:
        return {**self.counters, **self.admission.stats(), **self.cache.stats(),
                **mapping_stats(self.maps), **self.spec.stats(), "waiting": len(self.waiting),
                "running": len(self.running), "new_token_ratio": self.new_token_ratio,
                "grammar_compiles": self.grammars.compiles, "grammar_compiling":
                self.constraints.pending, "scheduler_seconds_total": self.scheduler_seconds}

    def check_invariants(self) -> None:
        self.cache.check_invariants(self.running, self.waiting)
