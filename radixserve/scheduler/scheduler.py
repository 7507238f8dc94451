"""The scheduler: which tokens run in the next step, and where their KV goes. No sockets, no
torch.

A step is a pipeline of phases, each in its own module with its contract:

1. **requests in** (`add_request`, `abort`, `pin`): here;
2. **grow or retract the running batch, then admit** (scheduler/running_batch.py, which
   calls scheduler/admission.py);
3. **build the step** for the worker (scheduler/batch.py);
4. **fold the result in and finish**: each sequence advanced by what the worker computed,
   and every sequence that leaves the batch, for good or retracted (scheduler/finish.py).

Every cache matter is the `CacheService` (scheduler/cache_service.py); a request's outputs,
samples and beams alike, are its `SeqGroup` (scheduler/request.py). An optional feature
(overlap, speculation, tenant shares, pins, the disk tier, output constraints, the
virtual layout's mappings) is a set of hooks the pipeline holds only while it is on
(scheduler/features.py): with it off, nothing of it runs in a step.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any

from radixserve.config import EngineConfig
from radixserve.messages import (Control, ControlReply, ForwardBatch, ForwardResult,
                                 RequestRejected, RequestUpdate, TokenizedRequest, WorkerInfo)
from radixserve.scheduler.admission import Admission
from radixserve.scheduler.batch import ScheduledBatch, build_forward_batch
from radixserve.scheduler.cache_service import CacheService
from radixserve.scheduler.features import F, OverloadedError, StepHooks
from radixserve.scheduler.finish import ABORTED, Finishing, Folding
from radixserve.scheduler.grammar import Grammar
from radixserve.scheduler.grammar_compiler import Compile, CompilerBusy, GrammarCompiler
from radixserve.scheduler.loras import LoraRegistry
from radixserve.scheduler.mappings import MappingAccount, mapping_stats
from radixserve.scheduler.overlap import RunAhead
from radixserve.scheduler.request import SeqGroup
from radixserve.scheduler.running_batch import RunningBatch
from radixserve.scheduler.state import SchedulerState
from radixserve.scheduler.worker_rows import WorkerRows
from radixserve.stop_strings import Decode

if TYPE_CHECKING:
    from radixserve.scheduler.constraints import ConstraintWaits
    from radixserve.scheduler.speculation import Speculation

__all__ = ["OverloadedError", "Scheduler"]


class Scheduler:
    def __init__(self, config: EngineConfig, info: WorkerInfo, decode: Decode | None = None,
                 eos_token_ids: list[int] | None = None, cache_events: bool = False,
                 cache_secret: bytes = b"", overlap: bool | None = None) -> None:
        """`cache_events`: record the tree's changes for `EngineCore.take_cache_events`,
        which must then be called after every step (what it has not taken accumulates).
        `cache_secret` keys the tree's page hashes (tenants.load_cache_secret). `overlap`:
        see `RunAhead.of`."""
        self.config, self.info, self.decode = config, info, decode
        self.page_size = info.page_size
        self.state = state = SchedulerState(config)
        self.waiting, self.running, self.groups = state.waiting, state.running, state.groups
        self.counters = state.counters
        self.outbox: list[ControlReply | RequestRejected] = []
        """What the loop sends besides the steps' updates, drained by it after each step:
        answers that came after their call (a pin's, once its prefill finished; the
        worker's calls', `EngineCore.step`) and requests refused after they were taken
        (their constraint did not compile)."""
        self.loras = LoraRegistry(config, info.loras)  # adapters, and their device slots
        self.cache = CacheService(config, info, self.outbox, cache_events, cache_secret,
                                  self.loras.name_of)
        self.eos_ids = frozenset(info.eos_token_ids) | frozenset(eos_token_ids or ())
        self.grammars = GrammarCompiler(info.model_path, info.vocab_size, sorted(self.eos_ids),
                                        config.max_grammar_compile_seconds,
                                        config.grammar_compile_threads,
                                        config.max_pending_grammar_compiles,
                                        config.max_grammar_compiles_per_tenant)
        """Output constraints (regex, JSON schema, ...), compiled off this loop, cached."""
        self.constraints: ConstraintWaits | None = None
        """Requests whose constraint compiles, from the first request with a constraint."""
        self.maps = MappingAccount.for_budget(info.kv_mapping_budget)  # virtual layout's VMAs
        self.hooks = StepHooks()
        self.finishing = Finishing(state, self.cache, self.hooks)
        self.admission = Admission(config, self.cache, self.maps, self.loras, state)
        self.running_batch = RunningBatch(state, self.cache, self.hooks, self.finishing,
                                          self.admission, self.maps)
        self.folding = Folding(state, self.cache, self.finishing, self.eos_ids, decode)
        self.overlap = RunAhead.of(config, info, self.cache.kv, overlap)  # steps in flight
        self.worker_rows = WorkerRows.of(info, self.loras, self.overlap is not None)
        self._rng = random.Random(config.seed)
        self._aborts: dict[str, dict[str, Any]] = {}
        """Requests to end at the start of the next step, each with its finish reason."""
        self._tenants: set[str] = set()
        self.scheduler_seconds = 0.0
        """Time spent in schedule() and process_result(): the scheduler's own overhead."""
        self._turn_on_configured()

    # -- the features on --------------------------------------------------------------
    def turn_on(self, feature: F) -> F:
        """Hold `feature`'s hooks from now on (see scheduler/features.py)."""
        return self.hooks.add(feature)

    def _turn_on_configured(self) -> None:
        """The features the config and the worker turn on from the start."""
        cache = self.cache
        for feature in (self.maps, self.overlap):
            if feature is not None:
                self.turn_on(feature)
        if self.config.speculative != "off":
            self._turn_on_speculation()
        if cache.radix_cache.disk is not None or cache.pins.pins:
            from radixserve.scheduler.cache_steps import DiskSteps, PinSteps
            self.turn_on(PinSteps(cache))
            if cache.radix_cache.disk is not None:
                self.turn_on(DiskSteps(cache))
        if self.config.max_running_requests_per_tenant:  # binds one tenant alone
            self._turn_on_shares()

    def _turn_on_speculation(self) -> None:
        from radixserve.scheduler.speculation import Speculation
        self.folding.spec = self.turn_on(
            Speculation(self.config, self.cache.index, self.cache.kv, self.maps))

    def _turn_on_shares(self) -> None:
        from radixserve.scheduler.shares import TenantShares
        self.admission.shares = self.turn_on(TenantShares(self.config, self.cache.kv,
                                                          self.loras))

    @property
    def spec(self) -> Speculation | None:
        """Speculative decoding, once on."""
        return self.folding.spec

    # -- requests in ------------------------------------------------------------------
    def add_request(self, request: TokenizedRequest) -> None:
        """Queue a request (validated at the edge, front_door/requests.py) as sequences
        `(rid, index)` (samples after the first fork from it once it has the prompt). Raises
        ValueError (it can never run here: e.g. an unknown adapter), OverloadedError (queue,
        its tenant's share of it or grammar compiler full). One whose constraint is compiling
        waits outside the queue (`self.constraints`), refused through the outbox if it
        fails."""
        if request.rid in self.groups:
            raise ValueError(f"rid {request.rid!r} is already in use")
        if request.lora is not None:
            request = self.loras.bind(request)  # in its adapter's cache namespace, or refused
        group = SeqGroup.of(request, self._rng, self.eos_ids)
        # The queue counts sequences (samples and beams), and so does its share of it.
        width, config = group.queued_width, self.config
        queued = sum([r.group.queued_width for r in self.waiting])
        if queued + width > config.max_queued_requests:
            raise OverloadedError(f"server overloaded: {queued} requests waiting "
                                  f"(max_queued_requests={config.max_queued_requests})")
        if queued + width > config.max_queued_requests_per_tenant:  # the tenant's may bind
            from radixserve.scheduler.shares import check_queue_share
            check_queue_share(config, self.waiting, group)
        # The features it needs that are not on yet:
        if request.sampling.speculative not in (None, "off") and self.spec is None:
            self._turn_on_speculation()
        if request.tenant not in self._tenants:
            self._tenants.add(request.tenant)
            if len(self._tenants) == 2:  # one tenant alone has no share to keep
                self._turn_on_shares()
        self._aborts.pop(request.rid, None)  # meant for an earlier request of that rid
        constraint: Grammar | Compile | None = None
        if (wanted := request.sampling.constraint) is not None:
            if self.constraints is None:
                from radixserve.scheduler.constraints import ConstraintWaits
                self.constraints = ConstraintWaits(self.grammars, self.state, self.outbox)
            try:
                constraint = self.constraints.lookup(request, wanted)
            except CompilerBusy as e:
                raise OverloadedError(str(e)) from None
        self.groups[request.rid] = group
        if isinstance(constraint, Compile):
            assert self.constraints is not None
            self.turn_on(self.constraints).wait(group, constraint)
            return
        if constraint is not None:
            group.set_grammar(constraint)
        self.waiting.append(group.seqs[0])  # its leader: any other sample forks from it

    def abort(self, rid: str, reason: dict[str, Any] = ABORTED) -> None:
        """Abort every output of the request `rid` at the start of the next step, for
        `reason` (by default: by its client)."""
        self._aborts.setdefault(rid, reason)

    def pin(self, msg: Control, prefill: TokenizedRequest) -> ControlReply | None:
        """Pin `prefill`'s prefix (a `PinCall` in `msg`; see scheduler/cache_service.py):
        the answer now, or None when it comes through the outbox once `prefill` has
        computed the prefix (it was not cached whole)."""
        from radixserve.scheduler.cache_steps import PinSteps
        self.turn_on(PinSteps(self.cache))
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
        updates: list[RequestUpdate] = []
        if self._aborts:
            updates = self.finishing.abort(self._aborts)
            self._aborts.clear()
        for start_step in self.hooks.start_step:
            start_step()
        seqs = self.running_batch.plan()
        self.scheduler_seconds += time.perf_counter() - start
        if not seqs and not any([wants() for wants in self.hooks.wants_step]):
            return None, updates
        self.counters["steps"] += 1
        kv = self.cache.kv
        forward = build_forward_batch(seqs, self.worker_rows, self.running, kv.copies,
                                      self.eos_ids)
        kv.copies = []  # this step carries them
        batch = ScheduledBatch(seqs, forward)
        for launched in self.hooks.launched:
            launched(batch)
        self.state.in_flight += 1
        return batch, updates

    def process_result(self, batch: ScheduledBatch, result: ForwardResult) -> list[RequestUpdate]:
        """Advance each sequence of `batch` by the worker's result; finish those that are done."""
        start = time.perf_counter()
        self.state.in_flight -= 1
        hooks = self.hooks
        dropped = hooks.dropped(batch, result) if hooks.folded else set()
        updates = self.folding.fold(batch, result, dropped)
        if self.config.debug_invariants:
            self.check_invariants()
        self.scheduler_seconds += time.perf_counter() - start
        return updates

    def fail_batch(self, batch: ScheduledBatch, message: str) -> list[RequestUpdate]:
        """The worker could not run `batch`: end its requests with an error, keep serving."""
        self.state.in_flight -= 1
        self.worker_rows.forget_all()
        dropped = self.hooks.dropped(batch, None) if self.hooks.folded else set()
        failed = [s.req for i, s in enumerate(batch.seqs) if i not in dropped]
        return self.finishing.fail(failed, message)

    # -- the whole cache and the end ----------------------------------------------------
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
        self.finishing.abort(dict.fromkeys(self.groups, ABORTED))
        return self.cache.close()

    @property
    def new_token_ratio(self) -> float:
        return self.state.new_token_ratio

    def stats(self) -> dict:
        spec = self.spec.stats() if self.spec is not None else {}
        compiling = self.constraints.pending if self.constraints is not None else 0
        return {**self.counters, **self.admission.stats(), **self.cache.stats(),
                **mapping_stats(self.maps), **spec, "waiting": len(self.waiting),
                "running": len(self.running), "new_token_ratio": self.new_token_ratio,
                "grammar_compiles": self.grammars.compiles, "grammar_compiling": compiling,
                "scheduler_seconds_total": self.scheduler_seconds}

    def check_invariants(self) -> None:
        self.cache.check_invariants(self.running, self.waiting)
