"""The scheduler: which tokens run in the next step, and where their KV goes.

It owns all KV bookkeeping (the radix tree and the block allocator) and no tensors: each
`schedule()` returns a ForwardBatch for the worker, and `process_result()` folds the
worker's sampled tokens back in and reports progress. No sockets, no torch.

For a cache-aware router it also describes itself (`take_cache_events`: what entered and
left the tree, and the load; `cache_snapshot`: the whole tree), in the terms of
`CacheEvents` (radixserve.messages); the scheduler process sends those on, the Engine does not.

Pins (scheduler/pins.py): a pin of a prefix that is not cached whole runs its
the pin's prefill request (max_new_tokens 0) like any request and pins the prefix when that
finishes, in the same call that inserted it, so nothing can evict it in between; its
answer comes from `take_control_replies`, and its own RequestUpdates go to nobody.

The disk tier (`kv_disk_dir`): the tree moves what it evicts to disk and the scheduler sends
the worker what to save, load and delete with each step (a step may carry nothing else,
when a load is all there is to do). Its index is saved every `kv_persist_interval` seconds
(`maybe_save_index`) and by `close`, which first writes every cached prefix out, so that a
scheduler started on the same directory resumes with the tree as it was, on disk.
"""

from __future__ import annotations

import math
import random
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from radixserve.cache.allocator import BlockAllocator
from radixserve.cache.disk import DiskTier
from radixserve.cache.persist import lock_store, open_store, save_index
from radixserve.cache.radix import RadixCache
from radixserve.cache.summary import HEAD_TOKENS
from radixserve.config import EngineConfig
from radixserve.messages import (CacheEvents, CacheScope, Caller, Control, ControlReply,
                                 ForwardBatch, ForwardResult, ReplicaLoad, RequestUpdate,
                                 SeqOutput, TokenizedRequest, TopLogprobs, UnpinCall,
                                 WorkerInfo)
from radixserve.scheduler.batch import ScheduledSeq, build_forward_batch, plan_seq
from radixserve.scheduler.beam import BeamCandidates, BeamSearch
from radixserve.scheduler.grammar import Compile, CompilerBusy, GrammarCompiler, GrammarState
from radixserve.scheduler.kv import KVManager, PrefixLoad
from radixserve.scheduler.pins import PinKey, PinnedPrefixes
from radixserve.scheduler.policy import order_waiting, waits_for_shared_prefix
from radixserve.scheduler.request import Req, Status
from radixserve.scheduler.stop import check_finish
from radixserve.stop_strings import Decode


class OverloadedError(RuntimeError):
    """The waiting queue is full; the request was not queued."""


@dataclass(eq=False)
class BeamGroup:
    """The running beams of one beam-search request, in the order its search expects."""

    rid: str
    search: BeamSearch
    beams: list[Req]


@dataclass
class ScheduledBatch:
    seqs: list[ScheduledSeq]
    forward: ForwardBatch
    loads: list[PrefixLoad] = field(default_factory=list)
    """Prefixes this step reads back from the disk tier."""


class Scheduler:
    def __init__(self, config: EngineConfig, info: WorkerInfo, decode: Decode | None = None,
                 eos_token_ids: list[int] | None = None, cache_events: bool = False,
                 cache_secret: bytes = b"") -> None:
        """`cache_events`: record the tree's changes for `take_cache_events`, which must
        then be called after every step (what it has not taken accumulates).
        `cache_secret` keys the tree's page hashes (tenants.load_cache_secret)."""
        self.config, self.info, self.decode = config, info, decode
        self.page_size = info.page_size
        self.allocator = BlockAllocator(info.num_blocks)
        disk = None
        if config.kv_disk_dir is not None and config.enable_prefix_cache:
            disk = DiskTier(config.kv_disk_size, info.kv_pool_bytes // info.num_blocks)
        self.tree = RadixCache(self.allocator, self.page_size, enabled=config.enable_prefix_cache,
                               record_events=cache_events, disk=disk, hash_key=cache_secret)
        self.disk_dir = Path(config.kv_disk_dir) if disk is not None else None
        if self.disk_dir is not None:
            self._disk_lock = lock_store(self.disk_dir)
            open_store(self.disk_dir, self.tree, info.kv_fingerprint, info.vocab_size)
        self._index_saved_at = time.monotonic()
        self.cache_epoch = secrets.token_hex(8)
        """Names this scheduler's tree in its CacheEvents: random, not from `config.seed`,
        so a restarted replica (whose tree starts empty) never reuses its old epoch."""
        self.cache_seq = 0
        """The `seq` of the last CacheEvents made (0: none yet)."""
        self._reported_load: ReplicaLoad | None = None
        self.kv = KVManager(self.allocator, self.tree, self.page_size,
                            load_cost=info.disk_load_seconds_per_token,
                            prefill_cost=info.prefill_seconds_per_token)
        pool = info.num_blocks * info.page_size
        self.pins = PinnedPrefixes(self.tree, config.pin_limit(pool))
        self._pinning: dict[str, tuple[Control, PinKey]] = {}
        """Pins waiting for their prefill, by the rid of that prefill."""
        self._control_replies: list[ControlReply] = []
        """Answers to pins that waited for their prefill, for `take_control_replies`."""
        self.eos_ids = frozenset(info.eos_token_ids) | frozenset(eos_token_ids or ())
        self.grammars = GrammarCompiler(info.model_path, info.vocab_size, sorted(self.eos_ids),
                                        config.max_grammar_compile_seconds,
                                        config.grammar_compile_threads,
                                        config.max_pending_grammar_compiles)
        """Output constraints (regex, JSON schema, ...), compiled on first use (off this
        loop) and cached."""
        self._compiling: dict[str, tuple[Req, Compile]] = {}
        """Requests waiting for their constraint to compile, by rid: (leader, compile)."""
        self._rejected: list[tuple[str, str, str]] = []
        """(rid, error code, message) of requests whose constraint failed to compile (or
        waited too long for a compile thread), for `take_rejections`."""
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.requests: dict[str, list[Req]] = {}
        """Each request's unfinished sequences (samples or beams), by rid."""
        self.new_token_ratio = config.init_new_token_ratio
        self._rng = random.Random(config.seed)
        self._aborts: list[str] = []
        self.counters = dict(steps=0, prefill_tokens=0, decode_tokens=0, retractions=0,
                             prompt_tokens=0, prompt_cached_tokens=0, finished=0,
                             aborted=0, cascade_steps=0, cascade_shared_runs=0,
                             forked_samples=0)
        self.peak_used_blocks = 0
        """Most blocks in use (held by sequences or cached) at once, at any step."""
        self.scheduler_seconds = 0.0
        """Time spent in schedule() and process_result(): the scheduler's own overhead."""

    # -- requests in ------------------------------------------------------------------
    def add_request(self, request: TokenizedRequest) -> None:
        """Queue a request (validated at the edge, see tokenizer/requests.py). Its outputs
        are sequences `(rid, index)`; with `n` > 1 the samples after the first wait for it
        to compute the prompt and then fork from it. Raises ValueError for a request that
        can never run here, OverloadedError when the queue (or the grammar compiler) is
        full. A request whose constraint is not compiled yet waits for it outside the queue
        (`_take_compiled`); if it does not compile, `take_rejections` says so."""
        if request.rid in self.requests:
            raise ValueError(f"rid {request.rid!r} is already in use")
        if request.rid in self._aborts:  # meant for an earlier request of that rid
            self._aborts = [rid for rid in self._aborts if rid != request.rid]
        queued = sum(self._width(r) for r in self.waiting)  # samples and beams count
        if queued + request.num_outputs > self.config.max_queued_requests:
            raise OverloadedError(
                f"server overloaded: {queued} requests waiting "
                f"(max_queued_requests={self.config.max_queued_requests})")
        grammar, compiling = None, None
        if request.sampling.constraint is not None:
            grammar = self.grammars.cached(*request.sampling.constraint,
                                           namespace=request.namespace)
            if grammar is None:
                try:
                    compiling = self.grammars.start(*request.sampling.constraint,
                                                    namespace=request.namespace)
                except CompilerBusy as e:
                    raise OverloadedError(str(e)) from None
        base_seed = request.sampling.seed
        seqs = []
        samples = 1 if request.beam is not None else request.sampling.n  # beams fork later
        for i in range(samples):
            seed = self._rng.getrandbits(62) if base_seed is None else base_seed + i
            req = Req.from_tokenized(request, i, seed)
            if grammar is not None:  # each sample its own state, from the same grammar
                req.grammar = GrammarState(grammar, request.sampling.ignore_eos)
            if req.return_logprob and req.logprob_start_len == 0:
                req.input_logprobs.append(None)  # the first token has no context to score it
                req.input_top.append(None)
            seqs.append(req)
        leader = seqs[0]
        leader.forks = seqs[1:]
        if request.beam is not None:
            leader.beams = self._beam_group(request, leader)
        self.requests[request.rid] = seqs
        if compiling is None:
            self.waiting.append(leader)
        else:
            self._compiling[request.rid] = (leader, compiling)

    def _beam_group(self, request: TokenizedRequest, prompt: Req) -> BeamGroup:
        sp, beam = request.sampling, request.beam
        stops = set(sp.stop_token_ids or ()) | (set() if sp.ignore_eos else self.eos_ids)
        search = BeamSearch(beam.width, sp.max_new_tokens, beam.length_penalty,
                            beam.early_stopping, eos_ids=stops)
        return BeamGroup(request.rid, search, [prompt])

    def _take_compiled(self) -> None:
        """Queue the requests whose constraint has compiled; drop (for `take_rejections`)
        those whose constraint failed, and those aborted meanwhile."""
        for rid, (leader, handle) in list(self._compiling.items()):
            seqs = self.requests.get(rid)
            if seqs is None or leader not in seqs:  # aborted while it compiled
                del self._compiling[rid]
                continue
            try:
                grammar = self.grammars.outcome(handle)
            except (ValueError, CompilerBusy) as e:
                del self._compiling[rid], self.requests[rid]
                code = "overloaded" if isinstance(e, CompilerBusy) else "invalid_request"
                self._rejected.append((rid, code, str(e)))
                continue
            if grammar is None:
                continue
            del self._compiling[rid]
            for req in seqs:  # each sample its own state, from the same grammar
                req.grammar = GrammarState(grammar, req.sampling.ignore_eos)
            self.waiting.append(leader)

    @property
    def compiling(self) -> bool:
        """Some request waits for its constraint to compile."""
        return bool(self._compiling)

    def take_rejections(self) -> list[tuple[str, str, str]]:
        """(rid, error code, message) of the requests refused since the last call: their
        constraint did not compile (invalid_request) or found no compile thread in time
        (overloaded). Nothing else is said about them (no RequestUpdate)."""
        out, self._rejected = self._rejected, []
        return out

    def abort(self, rid: str) -> None:
        """Abort every output of the request `rid` at the start of the next step."""
        self._aborts.append(rid)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborts)

    # -- one step ---------------------------------------------------------------------
    def schedule(self) -> tuple[ScheduledBatch | None, list[RequestUpdate]]:
        """Pick the next step's tokens. Returns the batch (None when idle) and the updates of
        requests that ended without running (aborts)."""
        start = time.perf_counter()
        self.pins.expire()
        updates = self._apply_aborts()
        self._take_compiled()
        seqs: list[ScheduledSeq] = []
        while not seqs and (self.running or self.waiting):
            seqs = self._pick()
            if seqs or self.kv.loads:
                break
            # Nothing could run for memory (every running request stuck mid-prefill, or a
            # beam waiting for its siblings' candidates, or the queue's head not fitting
            # beside the prefixes held for the others): a held prefix goes first (it costs
            # only a load to bring back), then the newest running request.
            if self.kv.held:
                self.kv.drop_holds()
            elif self.running:
                self._retract(self.running[-1])
            else:
                break
        self.scheduler_seconds += time.perf_counter() - start
        self.peak_used_blocks = max(self.peak_used_blocks, self.allocator.num_used)
        disk = self.tree.disk
        if not seqs and not (disk is not None and disk.has_transfers):
            return None, updates
        self.counters["steps"] += 1
        forward = build_forward_batch(seqs, self.page_size, self.kv.take_copies(), self.eos_ids)
        if disk is not None:
            disk.send_with(forward)
        return ScheduledBatch(seqs, forward, self.kv.take_loads()), updates

    def _pick(self) -> list[ScheduledSeq]:
        budget = self.config.chunked_prefill_size
        decodes = [r for r in self.running if r.to_compute == 1]
        while self.kv.blocks_for(decodes, 1) > self.kv.available_blocks:
            if self.kv.held:  # a held prefix goes before any running request
                self.kv.drop_holds()
                continue
            victim = self.running[-1]
            self._retract(victim)
            if victim in decodes:
                decodes.remove(victim)
        seqs = []
        for req in decodes:
            self.kv.grow(req, 1)
            seqs.append(plan_seq(req, 1))
            budget -= 1
        for req in self.running:
            if req.to_compute > 1 and budget > 0:
                n = self.kv.grow(req, min(req.to_compute, budget))
                if n:
                    seqs.append(plan_seq(req, n))
                    budget -= n
        if budget > 0:
            seqs.extend(self._admit(budget))
        return seqs

    @staticmethod
    def _width(req: Req) -> int:
        """The sequences `req` stands for: itself, its samples still to fork, and the beams
        a beam search's prompt becomes."""
        beams = req.beams.search.beam_width - len(req.beams.beams) if req.beams else 0
        return 1 + len(req.forks) + beams

    def _future_tokens(self, req: Req) -> int:
        """Admission's estimate of the tokens `req` (and what it forks into) will add after
        the prompt."""
        clipped = min(req.remaining_new_tokens, self.config.admission_max_new_tokens)
        return math.ceil(clipped * self.new_token_ratio) * self._width(req)

    def _admit(self, budget: int) -> list[ScheduledSeq]:
        seqs = []
        reserved = sum(r.to_compute + self._future_tokens(r) for r in self.running)
        computing = [r for r in self.running if r.kv_len < len(r.input_ids)]
        # Sequences, as max_running_requests counts them: a running prompt's samples still
        # to fork run from its next step on (the virtual KV layout has a view for each).
        running = sum(self._width(r) for r in self.running)
        for req in order_waiting(self.config.schedule_policy, self.waiting, self.tree):
            if budget <= 0 or (running + self._width(req)
                               > self.config.max_running_requests):
                break
            if req.candidates is not None or (req.loading is not None and req.loading.pending):
                continue  # a beam retracted with its step done waits for its siblings
            if self.tree.enabled and waits_for_shared_prefix(req, computing, self.tree):
                continue
            self.kv.attach_prefix(req)
            self.kv.drop_hold(req)  # attached: its own lock keeps the loaded prefix now
            future = self._future_tokens(req)
            room = self.kv.available_blocks * self.page_size
            if self.kv.start_load(req, room - reserved - future if self.running else None):
                continue
            need = req.to_compute + future
            n = 0
            if need + reserved <= room or not self.running:
                n = self.kv.grow(req, min(req.to_compute, budget))
            if n == 0:
                self.kv.release(req, cache=False)
                break
            if not req.admitted:  # counted once, however often admission was tried
                req.admitted, req.cached_tokens = True, req.kv_len
                self.counters["prompt_tokens"] += len(req.input_ids)
                self.counters["prompt_cached_tokens"] += req.kv_len
                self.tree.record_lookup(req.kv_len, len(req.input_ids))
                self.tree.record_hit(req.node)
                self.tree.disk_hit_tokens += min(req.disk_tokens, req.kv_len)
            self.waiting.remove(req)
            self.running.append(req)
            running += self._width(req)
            req.status = Status.RUNNING
            seqs.append(plan_seq(req, n))
            computing.append(req)
            budget -= n
            reserved += need
        return seqs

    def process_result(self, batch: ScheduledBatch, result: ForwardResult) -> list[RequestUpdate]:
        """Advance each sequence of `batch` by the worker's result; finish those that are done."""
        start = time.perf_counter()
        updates: list[RequestUpdate] = []
        self.kv.finish_loads(batch.loads, result.kv_failed)
        if result.shared_runs:
            self.counters["cascade_steps"] += 1
            self.counters["cascade_shared_runs"] += result.shared_runs
        for seq, out in zip(batch.seqs, result.outputs):
            req = seq.req
            if req.status is not Status.RUNNING:
                continue  # aborted or retracted while the step ran
            prefill = seq.start < len(req.input_ids)
            req.kv_len = seq.start + seq.n
            if out.input_logprobs is not None:
                req.input_logprobs.extend(out.input_logprobs)
                req.input_top.extend(out.input_top or [None] * len(out.input_logprobs))
            if req.kv_len >= len(req.input_ids) - 1:
                req.input_logprobs_done = True
            self.counters["prefill_tokens" if prefill else "decode_tokens"] += seq.n
            if prefill:
                self.kv.cache_progress(req)
            if not seq.sample:
                if req.kv_len == req.seq_len and req.remaining_new_tokens <= 0:
                    reason = {"type": "length", "length": req.sampling.max_new_tokens}
                    updates += self._finish(req, reason, new_token=False)
                continue
            if req.beams is not None:
                req.candidates = BeamCandidates(out.output_top.token_ids, out.output_top.logprobs)
                if all(b.candidates is not None for b in req.beams.beams):
                    updates += self._advance_beams(req.beams)
                continue
            self._take_token(req, out.next_token, out.output_logprob, out.output_top)
            sampled = [req]
            if req.forks:
                sampled += self._fork_samples(req, out)
            for r in sampled:
                reason = check_finish(r, self.eos_ids, self.decode)
                if reason is not None:
                    updates += self._finish(r, reason, new_token=True)
                else:
                    updates.append(r.update(True))
        self.new_token_ratio = max(self.config.min_new_token_ratio,
                                   self.new_token_ratio - self.config.new_token_ratio_decay)
        if self.config.debug_invariants:
            self.check_invariants()
        self.scheduler_seconds += time.perf_counter() - start
        return updates

    @staticmethod
    def _take_token(req: Req, token: int, logprob: float | None, top: TopLogprobs | None) -> None:
        req.output_ids.append(token)
        if req.grammar is not None:
            req.grammar.advance(token)
        if logprob is not None:
            req.output_logprobs.append(logprob)
            if top is not None:
                req.output_top.append(top)

    def _fork_samples(self, leader: Req, out: SeqOutput) -> list[Req]:
        """The leader has computed the prompt and sampled its first token; its other samples
        take their first tokens from the same logits and share its KV from here on."""
        forks, leader.forks = leader.forks, []
        for j, fork in enumerate(forks):
            self.kv.fork(leader, fork)
            self._take_token(fork, out.fork_tokens[j],
                             out.fork_logprobs[j] if out.fork_logprobs else None,
                             out.fork_top[j] if out.fork_top else None)
            self._inherit_prompt(fork, leader)
            fork.status = Status.RUNNING
            self.running.append(fork)
        self.counters["forked_samples"] += len(forks)
        return forks

    @staticmethod
    def _inherit_prompt(fork: Req, leader: Req) -> None:
        """A sample that forks from (or ends with) its leader has the leader's prompt results."""
        fork.input_logprobs, fork.input_top = list(leader.input_logprobs), list(leader.input_top)
        fork.input_logprobs_done = leader.input_logprobs_done
        fork.admitted, fork.cached_tokens = True, leader.cached_tokens

    def fail_batch(self, batch: ScheduledBatch, message: str) -> list[RequestUpdate]:
        """The worker could not run `batch`: end its requests with an error, keep serving.
        Their KV goes uncached: the block copies planned for this step (a kept partial
        block, a copy-on-write tail) never ran, so those blocks hold no valid tokens."""
        updates = []
        self.kv.finish_loads(batch.loads, None)
        for seq in batch.seqs:
            if seq.req.status is Status.RUNNING:
                self.kv.release(seq.req, cache=False)
                updates += self._end(seq.req, {"type": "abort", "message": message})
        return updates

    def _end(self, req: Req, reason: dict) -> list[RequestUpdate]:
        """End `req` without a new token: the whole request if it is a beam search."""
        if req.beams is not None:
            return self._end_beams(req.beams, reason)
        return self._finish(req, reason, new_token=False)

    # -- lifecycle --------------------------------------------------------------------
    def _finish(self, req: Req, reason: dict, new_token: bool) -> list[RequestUpdate]:
        """End `req` (and the samples still waiting to fork from it, for the same reason)
        and return their final updates."""
        req.finish_reason = reason
        self._remove(req, cache=True)
        self.counters["finished"] += 1
        if req.rid in self._pinning:  # its prefix is in the tree now: pin it before a step
            self._pinned(req, reason)
            return []
        updates = [req.update(new_token)]
        forks, req.forks = req.forks, []
        for fork in forks:
            self._inherit_prompt(fork, req)
            updates += self._finish(fork, reason, new_token=False)
        return updates

    def _retract(self, req: Req) -> None:
        """Give back a running request's blocks (its computed prefix stays cached) and queue
        it first in line; it resumes by recomputing, usually from the cache."""
        self.kv.release(req, cache=True)
        self.running.remove(req)
        req.status = Status.WAITING
        if not req.input_logprobs_done:
            keep = 1 if req.logprob_start_len == 0 else 0
            del req.input_logprobs[keep:], req.input_top[keep:]
        self.waiting.insert(0, req)
        self.counters["retractions"] += 1
        self.new_token_ratio = self.config.init_new_token_ratio

    def _apply_aborts(self) -> list[RequestUpdate]:
        updates = []
        for rid in self._aborts:
            for req in list(self.requests.get(rid, ())):
                if req.status is not Status.FINISHED:
                    updates += self._end(req, {"type": "abort", "message": "aborted by the client"})
                    self.counters["aborted"] += 1
        self._aborts.clear()
        return updates

    # -- beam search ------------------------------------------------------------------
    def _advance_beams(self, group: BeamGroup) -> list[RequestUpdate]:
        """Every beam has reported its best continuations: choose the next beams. A beam
        chosen once goes on in place, one chosen again forks (sharing its KV, the last block
        copied on first write), one not chosen lets its blocks go. The beams need not all be
        resident at once: one retracted after its step keeps its candidates and waits
        (`_admit` skips it) until this decision, so searches never block each other."""
        step = group.search.step([b.candidates for b in group.beams])
        for b in group.beams:
            b.candidates = None
        if step.done:
            return self._end_beams(group, None)
        parents, beams = group.beams, []
        taken: set[int] = set()
        for j, p in enumerate(step.parents):
            if p in taken:
                beams.append(self._fork_beam(parents[p], j))
            else:
                beams.append(parents[p])
                taken.add(p)
        # Only now, after the forks have copied their parents' tokens:
        for j, (beam, token) in enumerate(zip(beams, step.tokens)):
            beam.output_ids.append(token)
            beam.index = j
        for i, parent in enumerate(parents):
            if i not in taken:
                self._remove(parent, cache=False)  # a beam that fell out: no answer of its own
        group.beams = beams
        return []

    def _fork_beam(self, parent: Req, index: int) -> Req:
        """A copy of `parent` that shares its KV; a parent that was retracted after its step
        has none to share, so its copy waits to recompute (mostly from the tree) as it does."""
        child = Req(rid=parent.rid, index=index, input_ids=parent.input_ids,
                    sampling=parent.sampling, seed=parent.seed, status=parent.status,
                    output_ids=list(parent.output_ids), cached_tokens=parent.cached_tokens,
                    admitted=True, input_logprobs_done=True, beams=parent.beams,
                    namespace=parent.namespace)
        if parent.status is Status.RUNNING:
            self.kv.fork(parent, child)
            self.running.append(child)
        else:
            self.waiting.insert(0, child)
        self.requests[parent.rid].append(child)
        return child

    def _remove(self, req: Req, cache: bool) -> None:
        """Take a sequence out of the scheduler for good, its KV released (cached first if
        `cache`); a request goes when its last sequence does."""
        req.status = Status.FINISHED
        self.kv.release(req, cache=cache)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        seqs = self.requests[req.rid]
        seqs.remove(req)
        if not seqs:
            del self.requests[req.rid]

    def _end_beams(self, group: BeamGroup, reason: dict | None) -> list[RequestUpdate]:
        """The search is over (`reason` None: answer with its best hypotheses, best first)
        or ended early (`reason`: every output gets it)."""
        first = group.beams[0]
        for b in list(group.beams):
            self._remove(b, cache=True)  # the final beams' pages may serve a follow-up
        self.counters["finished"] += group.search.beam_width  # outputs, as for samples
        hyps = group.search.finish() if reason is None else []
        updates = []
        for i in range(group.search.beam_width):
            upd = RequestUpdate(rid=group.rid, index=i, prompt_tokens=len(first.input_ids),
                                cached_tokens=first.cached_tokens,
                                finish_reason=reason or {"type": "abort", "message":
                                                         "beam search found no hypothesis"})
            if i < len(hyps):
                h = hyps[i]
                upd.new_token_ids, upd.completion_tokens = h.output_ids, len(h.output_ids)
                upd.score, upd.cumulative_logprob = h.score, h.cum_logprob
                upd.finish_reason = ({"type": "stop", "matched": h.matched}
                                     if h.finish_reason == "stop" else
                                     {"type": "length", "length": group.search.max_new_tokens})
            updates.append(upd)
        return updates

    def flush_cache(self) -> bool:
        """Drop every cached prefix but the pinned ones (see `RadixCache.flush`); refused
        (False) while requests are queued or running."""
        if self.running or self.waiting:
            return False
        self.kv.flush()
        return True

    # -- the disk tier's index -------------------------------------------------------
    def maybe_save_index(self) -> None:
        """Save the tree's index if `kv_persist_interval` has passed since the last save."""
        interval = self.config.kv_persist_interval
        if (self.disk_dir is not None and interval > 0
                and time.monotonic() - self._index_saved_at >= interval):
            self.save_index()

    def save_index(self) -> None:
        assert self.disk_dir is not None
        save_index(self.disk_dir, self.tree, self.info.kv_fingerprint)
        self._index_saved_at = time.monotonic()

    def release_store(self) -> None:
        """Let another scheduler use the disk tier's directory (after the last save)."""
        self._disk_lock.close()

    def close(self) -> ForwardBatch | None:
        """Stop serving: end every request (aborted), drop the pins, and write every cached
        prefix to the disk tier. Returns the last step for the worker (the transfers, and
        wait until they are on disk), after which `save_index` records the tree; None
        without a disk tier."""
        disk = self.tree.disk
        if disk is None:
            return None
        self._aborts.extend(self.requests)
        self._apply_aborts()
        self.pins.unpin(list(self.pins.pins))
        self.kv.flush_partials()
        self.tree.evict(sys.maxsize)
        forward = disk.send_with(build_forward_batch([], self.page_size, [], self.eos_ids))
        forward.kv_sync = True
        return forward

    # -- pins and the cache view -----------------------------------------------------
    def pin(self, msg: Control, req: TokenizedRequest) -> ControlReply | None:
        """Pin `req`'s prefix (a `PinCall` in `msg`; see the module docstring): the answer
        now, or None when it comes from `take_control_replies` once `req` has prefilled
        the prefix (it was not cached whole)."""
        ttl, owner, quota = msg.op.ttl, msg.caller.owner, msg.caller.quota  # type: ignore[union-attr]
        key = PinnedPrefixes.key(req.input_ids, self.page_size, req.namespace)
        try:
            if not self.tree.enabled:
                raise ValueError("pinning needs the prefix cache (enable_prefix_cache is off)")
            if not key[1]:
                raise ValueError(f"the prefix has {len(req.input_ids)} tokens, less than one "
                                 f"page (page_size={self.page_size}): nothing to pin")
            self.pins.expire()
            if key not in self.pins.pins:
                self.pins.check_size(len(key[1]), owner, quota)
            if key in self.pins.pins or self.tree.match_prefix(
                    key[1], peek=True, namespace=key[0]).length == len(key[1]):
                return ControlReply(msg.call_id, self.pins.pin(key, ttl, owner, quota))
            self.add_request(req)
        except (ValueError, OverloadedError) as e:
            return ControlReply(msg.call_id, {}, error=str(e))
        self._pinning[req.rid] = (msg, key)
        return None

    def _pinned(self, req: Req, reason: dict) -> None:
        msg, key = self._pinning.pop(req.rid)
        if reason.get("type") == "abort":
            reply = ControlReply(msg.call_id, {}, error=f"the prefix was not prefilled: "
                                 f"{reason.get('message', 'aborted')}")
        else:
            try:
                reply = ControlReply(msg.call_id, self.pins.pin(
                    key, msg.op.ttl, msg.caller.owner, msg.caller.quota))  # type: ignore[union-attr]
            except ValueError as e:
                reply = ControlReply(msg.call_id, {}, error=str(e))
        self._control_replies.append(reply)

    def unpin(self, op: UnpinCall, caller: Caller) -> dict:
        """Drop the pin of `op.input_ids` in the caller's namespace, or with `op.all` every
        pin in the caller's scope; the answer gives the caller's (owner's) pinned total."""
        self.pins.expire()
        if op.all:
            return self.pins.unpin([k for k in self.pins.pins if caller.scope.admits(k[0])],
                                   caller.owner)
        return self.pins.unpin([PinnedPrefixes.key(op.input_ids or [], self.page_size,
                                                   caller.namespace)], caller.owner)

    def take_control_replies(self) -> list[ControlReply]:
        """Answers to pins that waited for their prefill, since the last call."""
        replies, self._control_replies = self._control_replies, []
        return replies

    def cache_info(self, top: int, scope: CacheScope = CacheScope()) -> dict:
        """`RadixCache.summary` (its `top` prefixes) of the namespaces `scope` admits, with
        their pins (`{"namespace", "tokens", "expires_in", "head_ids"}`) and the limit."""
        self.pins.expire()
        admits = scope.admits
        info = self.tree.summary(top, admits)
        now = time.monotonic()
        info["pins"] = [{"namespace": ns, **pin.describe(now),
                         "head_ids": list(tokens[:HEAD_TOKENS])}
                        for (ns, tokens), pin in self.pins.pins.items() if admits(ns)]
        info["max_pinned_tokens"] = self.pins.max_pinned_tokens
        return info

    # -- for a router -----------------------------------------------------------------
    def load(self) -> ReplicaLoad:
        """How busy this scheduler is. Requests count as sequences (each sample or beam,
        including samples still to fork from a queued prompt), as `max_queued_requests`
        and `max_running_requests` count them. `waiting_tokens`: what the queued sequences
        must still prefill (their whole context: a queued one holds no KV, and the part
        the cache will cover is only known when it is admitted); `running_tokens`: the KV
        the running ones hold (a running prompt's unprefilled rest is in neither)."""
        waiting, running = self.waiting, self.running
        return ReplicaLoad(waiting_requests=sum(self._width(r) for r in waiting),
                           running_requests=len(running),
                           waiting_tokens=sum(r.to_compute for r in waiting),
                           running_tokens=sum(r.kv_len for r in running))

    def take_cache_events(self, heartbeat: bool = False) -> CacheEvents | None:
        """The next CacheEvents: the page hashes that entered and left the tree since the
        previous one, and the load now. None when neither changed, unless `heartbeat`.
        Needs `cache_events=True` at construction."""
        changes = self.tree.take_events()
        load = self.load()
        if not changes and load == self._reported_load and not heartbeat:
            return None
        self._reported_load = load
        self.cache_seq += 1
        return CacheEvents(epoch=self.cache_epoch, seq=self.cache_seq, page_size=self.page_size,
                           stored=changes.stored, removed=changes.removed,
                           cleared=changes.cleared, load=load)

    def cache_snapshot(self) -> dict:
        """Every page hash in the tree now, for a subscriber that lost track (see
        CacheEvents): `seq` is the last CacheEvents made, so the subscriber applies those
        after it. Events it then gets may repeat what the snapshot already holds, which is
        harmless: each is a set operation whose result is the tree after that event.
        `load` is a ReplicaLoad (over RPC an array, as in CacheEvents: `msgspec.convert(
        snapshot["load"], ReplicaLoad)` reads it back)."""
        return {"epoch": self.cache_epoch, "seq": self.cache_seq, "page_size": self.page_size,
                "hashes": self.tree.page_hashes_in_tree(), "load": self.load()}

    def stats(self) -> dict:
        self.pins.expire()  # so that pinned_tokens is never a lapsed pin's
        c = self.counters
        return {
            **c, **self.tree.stats(),
            "cache_hit_rate": c["prompt_cached_tokens"] / max(c["prompt_tokens"], 1),
            "num_blocks": self.allocator.num_blocks, "free_blocks": self.allocator.num_free,
            "evictable_blocks": self.kv.evictable_blocks, "locked_blocks": self.tree.locked_blocks,
            "partial_blocks": len(self.kv.partials), "partial_tokens": self.kv.partial_tokens,
            "pool_usage": 1 - self.allocator.num_free / self.allocator.num_blocks,
            "waiting": len(self.waiting), "running": len(self.running),
            "new_token_ratio": self.new_token_ratio, "copied_blocks": self.kv.copied_blocks,
            "peak_used_blocks": self.peak_used_blocks,
            "grammar_compiles": self.grammars.compiles,
            "grammar_compiling": len(self._compiling),
            "scheduler_seconds_total": self.scheduler_seconds,
        }

    def check_invariants(self) -> None:
        self.kv.check_invariants(self.running)
        assert all(not r.block_table for r in self.waiting), "a waiting request holds blocks"
