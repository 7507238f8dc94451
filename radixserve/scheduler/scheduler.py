"""The scheduler: which tokens run in the next step, and where their KV goes.

It owns all KV bookkeeping (the radix tree and the block allocator) and no tensors: each
`schedule()` returns a ForwardBatch for the worker, and `process_result()` folds the
worker's sampled tokens back in and reports progress. No sockets, no torch.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

from radixserve.cache.allocator import BlockAllocator
from radixserve.cache.radix import RadixCache
from radixserve.config import EngineConfig
from radixserve.messages import (ForwardBatch, ForwardResult, RequestUpdate, TokenizedRequest,
                                 WorkerInfo)
from radixserve.scheduler.batch import ScheduledSeq, build_forward_batch, plan_seq
from radixserve.scheduler.grammar import CompiledRegex, RegexCompiler, RegexState
from radixserve.scheduler.kv import KVManager
from radixserve.scheduler.policy import order_waiting, waits_for_shared_prefix
from radixserve.scheduler.request import Req, Status
from radixserve.scheduler.stop import Decode, check_finish
from radixserve.scheduler.validate import validate_request


class OverloadedError(RuntimeError):
    """The waiting queue is full; the request was not queued."""


@dataclass
class ScheduledBatch:
    seqs: list[ScheduledSeq]
    forward: ForwardBatch


class Scheduler:
    def __init__(self, config: EngineConfig, info: WorkerInfo, decode: Decode | None = None,
                 eos_token_ids: list[int] | None = None) -> None:
        self.config, self.info, self.decode = config, info, decode
        self.page_size = info.page_size
        self.allocator = BlockAllocator(info.num_blocks)
        self.tree = RadixCache(self.allocator, self.page_size, enabled=config.enable_prefix_cache)
        self.kv = KVManager(self.allocator, self.tree, self.page_size)
        self.eos_ids = set(info.eos_token_ids) | set(eos_token_ids or ())
        self.regexes = RegexCompiler(info.model_path, info.vocab_size, sorted(self.eos_ids))
        """Token-level regex indexes, built on first use of each pattern and cached."""
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.requests: dict[str, Req] = {}
        self.new_token_ratio = config.init_new_token_ratio
        self._rng = random.Random(config.seed)
        self._aborts: list[str] = []
        self.counters = dict(steps=0, prefill_tokens=0, decode_tokens=0, retractions=0,
                             prompt_tokens=0, prompt_cached_tokens=0, finished=0,
                             aborted=0, cascade_steps=0, cascade_shared_runs=0)
        self.scheduler_seconds = 0.0
        """Time spent in schedule() and process_result(): the scheduler's own overhead."""

    # -- requests in ------------------------------------------------------------------
    def add_request(self, request: TokenizedRequest) -> list[str]:
        """Queue a request (its `n` samples as `rid:i`); returns the queued rids.
        Raises ValueError for a request that can never run, OverloadedError when full."""
        validate_request(request, self.info, self.config)
        compiled = self._compile_regex(request)
        n = request.sampling.n
        if len(self.waiting) + n > self.config.max_queued_requests:
            raise OverloadedError(
                f"server overloaded: {len(self.waiting)} requests waiting "
                f"(max_queued_requests={self.config.max_queued_requests})")
        rids = request.sample_rids()
        if any(rid in self.requests for rid in rids):
            raise ValueError(f"rid {request.rid!r} is already in use")
        base_seed = request.sampling.seed
        for i, rid in enumerate(rids):
            seed = self._rng.getrandbits(62) if base_seed is None else base_seed + i
            req = Req.from_tokenized(request, seed, rid)
            if compiled is not None:
                req.regex = RegexState(compiled, request.sampling.ignore_eos)
            if req.return_logprob and req.logprob_start_len == 0:
                req.input_logprobs.append(None)  # the first token has no context to score it
                req.input_top.append(None)
            self.requests[rid] = req
            self.waiting.append(req)
        return rids

    def _compile_regex(self, request: TokenizedRequest) -> CompiledRegex | None:
        regex = request.sampling.regex
        if regex is None:
            return None
        compiled = self.regexes.compile(regex)
        start = compiled.initial_state
        if compiled.dead(start) or (compiled.is_final(start) and not compiled.can_continue(start)):
            raise ValueError(f"sampling_params.regex {regex!r} admits no non-empty output "
                             "in this vocabulary")
        return compiled

    def abort(self, rid: str) -> None:
        """Abort `rid` (and its `rid:i` samples) at the start of the next step."""
        self._aborts.append(rid)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborts)

    # -- one step ---------------------------------------------------------------------
    def schedule(self) -> tuple[ScheduledBatch | None, list[RequestUpdate]]:
        """Pick the next step's tokens. Returns the batch (None when idle) and the updates of
        requests that ended without running (aborts)."""
        start = time.perf_counter()
        updates = self._apply_aborts()
        seqs: list[ScheduledSeq] = []
        while not seqs and (self.running or self.waiting):
            seqs = self._pick()
            if not seqs and self.running:
                # Every running request is stuck mid-prefill for memory: free the newest.
                self._retract(self.running[-1])
            elif not seqs:
                break
        self.scheduler_seconds += time.perf_counter() - start
        if not seqs:
            return None, updates
        self.counters["steps"] += 1
        return ScheduledBatch(seqs, build_forward_batch(seqs, self.page_size)), updates

    def _pick(self) -> list[ScheduledSeq]:
        budget = self.config.chunked_prefill_size
        decodes = [r for r in self.running if r.to_compute == 1]
        while self.kv.blocks_for(decodes, 1) > self.kv.available_blocks:
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

    def _admit(self, budget: int) -> list[ScheduledSeq]:
        seqs = []
        reserved = sum(r.to_compute + math.ceil(r.remaining_new_tokens * self.new_token_ratio)
                       for r in self.running)
        computing = [r for r in self.running if r.kv_len < len(r.input_ids)]
        for req in order_waiting(self.config.schedule_policy, self.waiting, self.tree):
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            if self.tree.enabled and waits_for_shared_prefix(req, computing, self.tree):
                continue
            self.kv.attach_prefix(req)
            need = req.to_compute + math.ceil(req.remaining_new_tokens * self.new_token_ratio)
            room = self.kv.available_blocks * self.page_size
            n = 0
            if need + reserved <= room or not self.running:
                n = self.kv.grow(req, min(req.to_compute, budget))
            if n == 0:
                self.kv.release(req, cache=False)
                break
            if not req.admitted:
                req.admitted, req.cached_tokens = True, req.kv_len
                self.counters["prompt_tokens"] += len(req.input_ids)
                self.counters["prompt_cached_tokens"] += req.kv_len
            self.waiting.remove(req)
            self.running.append(req)
            req.status = Status.RUNNING
            seqs.append(plan_seq(req, n))
            computing.append(req)
            budget -= n
            reserved += need
        return seqs

    def process_result(self, batch: ScheduledBatch, result: ForwardResult) -> list[RequestUpdate]:
        """Advance each sequence of `batch` by the worker's result; finish those that are done."""
        start = time.perf_counter()
        updates = []
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
            reason = None
            if seq.sample:
                req.output_ids.append(out.next_token)
                if req.regex is not None:
                    req.regex.advance(out.next_token)
                if out.output_logprob is not None:
                    req.output_logprobs.append(out.output_logprob)
                    if out.output_top is not None:
                        req.output_top.append(out.output_top)
                reason = check_finish(req, self.eos_ids, self.decode)
            elif req.kv_len == req.seq_len and req.remaining_new_tokens <= 0:
                reason = {"type": "length", "length": req.sampling.max_new_tokens}
            if reason is not None:
                self._finish(req, reason)
            elif prefill:
                self.kv.cache_progress(req)
            if seq.sample or reason is not None:
                updates.append(req.update(seq.sample))
        self.new_token_ratio = max(self.config.min_new_token_ratio,
                                   self.new_token_ratio - self.config.new_token_ratio_decay)
        if self.config.debug_invariants:
            self.check_invariants()
        self.scheduler_seconds += time.perf_counter() - start
        return updates

    def fail_batch(self, batch: ScheduledBatch, message: str) -> list[RequestUpdate]:
        """The worker could not run `batch`: end its requests with an error, keep serving."""
        updates = []
        for seq in batch.seqs:
            if seq.req.status is Status.RUNNING:
                self._finish(seq.req, {"type": "abort", "message": message})
                updates.append(seq.req.update(False))
        return updates

    # -- lifecycle --------------------------------------------------------------------
    def _finish(self, req: Req, reason: dict) -> None:
        req.finish_reason = reason
        req.status = Status.FINISHED
        self.kv.release(req, cache=True)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        del self.requests[req.rid]
        self.counters["finished"] += 1

    def _retract(self, req: Req) -> None:
        """Give back a running request's private blocks (its computed prefix stays cached)
        and queue it first in line; it resumes by recomputing, usually from the cache."""
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
            for req in [r for key, r in self.requests.items()
                        if key == rid or key.rpartition(":")[0] == rid]:
                self._finish(req, {"type": "abort", "message": "aborted by the client"})
                self.counters["aborted"] += 1
                updates.append(req.update(False))
        self._aborts.clear()
        return updates

    def flush_cache(self) -> bool:
        """Drop every cached prefix; refused (False) while requests are queued or running."""
        if self.running or self.waiting:
            return False
        self.tree.flush()
        return True

    def stats(self) -> dict:
        c = self.counters
        return {
            **c, **self.tree.stats(),
            "cache_hit_rate": c["prompt_cached_tokens"] / max(c["prompt_tokens"], 1),
            "num_blocks": self.allocator.num_blocks, "free_blocks": self.allocator.num_free,
            "evictable_blocks": self.tree.evictable_blocks, "locked_blocks": self.tree.locked_blocks,
            "pool_usage": 1 - self.allocator.num_free / self.allocator.num_blocks,
            "waiting": len(self.waiting), "running": len(self.running),
            "new_token_ratio": self.new_token_ratio,
            "scheduler_seconds_total": self.scheduler_seconds,
        }

    def check_invariants(self) -> None:
        self.kv.check_invariants(self.running)
