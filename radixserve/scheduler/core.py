"""The engine core: one step of serving (schedule, run the worker, fold the result in),
the one loop body that both the in-process `Engine` and the scheduler process drive.

It knows no sockets and no torch: the worker is anything with `forward(ForwardBatch) ->
ForwardResult`, the same in two halves (`launch`, then `collect`) and `control(WorkerCall)`
(the `Worker` itself in-process, a socket proxy in the scheduler process). With overlap
scheduling (scheduler/overlap.py) each step is launched before the result of the one before
it is collected and folded in.
Requests and control operations are typed methods, and `handle` maps the scheduler
process's typed messages onto them through one table (`_operations`, by the operation's
struct type), so every message kind has exactly one meaning.

What a loop does each turn: wait for messages as long as `wait_limit` allows (handing
each to `handle`, which may answer at once), `step`, send the step's updates, and drain
`outbox` (the answers and refusals that came later than their message).

For a cache-aware router, the scheduler process also sends `take_cache_events` after each
step (and `cache_snapshot` answers a subscriber that lost track): what entered and left
the tree, and the scheduler's load (`load`), in the terms of `CacheEvents`
(radixserve.messages).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Iterator
from typing import Any, Callable, ContextManager, Protocol, cast, overload

from radixserve.cache.block_events import BlockEventLog
from radixserve.cache.events import TreeEvents
from radixserve.messages import (AbortCall, CacheEvents, CacheInfoCall, CacheSnapshotCall, Control,
                                 ControlReply, FlushCacheCall, ForwardBatch, ForwardResult,
                                 LoadLoraCall, LorasCall, PinCall, ProfileCall, ReplicaLoad,
                                 RequestRejected, RequestUpdate, SamplingParams, SchedulerInput,
                                 StatsCall, TokenizedRequest, UnloadLoraCall, UnpinCall,
                                 WorkerCall, WorkerInfo)
from radixserve.results.errors import ErrorCode
from radixserve.rids import mint_rid
from radixserve.scheduler.batch import ScheduledBatch
from radixserve.scheduler.overlap import Outcome, Pipeline, StepRunner
from radixserve.scheduler.scheduler import OverloadedError, Scheduler
from radixserve.scheduler.worker_calls import WorkerCalls

log = logging.getLogger(__name__)

COMPILE_POLL = 0.01
"""How often (seconds) an otherwise idle loop looks whether a constraint has compiled: its
compile thread tells nobody when it is done."""


class ForwardRunner(StepRunner, Protocol):
    def forward(self, batch: ForwardBatch) -> ForwardResult:
        """`launch` then `collect`: one step, waited for."""
        ...

    def control(self, call: WorkerCall) -> dict[str, Any]:
        """Run a control call between steps; raises ValueError when refused."""
        ...


def _answer(payload: Callable[[Control], dict[str, Any]]) -> Callable[[Control], ControlReply]:
    """An operation answered at once: `payload` of the message, under its call id."""
    return lambda msg: ControlReply(msg.call_id, payload(msg))


class EngineCore:
    def __init__(self, scheduler: Scheduler, worker: ForwardRunner, info: WorkerInfo,
                 lock: ContextManager[Any] | None = None) -> None:
        self.scheduler, self.worker, self.info = scheduler, worker, info
        self.lock = lock if lock is not None else contextlib.nullcontext()
        """Held around the scheduler's bookkeeping, released while the worker computes (the
        Engine's callers queue requests meanwhile)."""
        self.forward_seconds = 0.0
        """The worker's time in the steps (with overlap: in launching them and waiting)."""
        self.stall_seconds = scheduler.config.scheduler_stall_seconds
        self.slow_steps = 0
        """Steps that took longer than `scheduler_stall_seconds`."""
        self.longest_step = 0.0
        self.pipeline = Pipeline(worker) if scheduler.overlap is not None else None
        """With overlap scheduling, the step in flight on the worker."""
        self.worker_calls = WorkerCalls(scheduler, self.lock)
        """Control calls for the worker, run by the next `step` that finds none in flight."""
        self.outbox = scheduler.outbox
        """What the loop sends besides a step's updates (`Scheduler.outbox`): drain it after
        each `step`, from the thread that runs the steps (under `lock`)."""
        self.epoch = secrets.token_hex(8)
        """Names this tree in its CacheEvents: random, not from `config.seed`, so a
        restarted replica (whose tree starts empty) never reuses its old epoch."""
        self.event_seq = 0
        """The `seq` of the last CacheEvents made (0: none yet)."""
        self._reported_load: ReplicaLoad | None = None
        cache, answer = self.scheduler.cache, _answer
        self._operations: dict[type, Callable[[Control], ControlReply | None]] = {
            AbortCall: self._abort,
            FlushCacheCall: lambda msg: self.flush_cache(msg.call_id),
            StatsCall: answer(lambda msg: self.stats()),
            CacheSnapshotCall: answer(lambda msg: self.cache_snapshot(
                cast(CacheSnapshotCall, msg.op).blocks)),
            PinCall: self._pin,
            # The key is the type of `msg.op`, which a lambda cannot declare: hence the casts.
            UnpinCall: answer(lambda msg: cache.unpin(cast(UnpinCall, msg.op), msg.caller)),
            CacheInfoCall: answer(lambda msg: cache.cache_info(cast(CacheInfoCall, msg.op).top,
                                                               msg.caller.scope)),
            ProfileCall: self.worker_calls.profile,
            LoadLoraCall: self.worker_calls.load_lora,
            UnloadLoraCall: self.worker_calls.unload_lora,
            LorasCall: answer(lambda msg: {"loras": self.scheduler.loras.describe(
                operator=msg.caller.scope.prefix is None)})}
        """What each control operation does, by its type: its answer now, or None (an
        abort has none; a profile's and a virtual layout's flush's come through `outbox`
        once the worker has run them, a pin's may come there after its prefill)."""

    # -- requests and control ---------------------------------------------------------
    def submit(self, request: TokenizedRequest) -> None:
        """Queue a request; raises ValueError (invalid here) or OverloadedError (queue full)."""
        self.scheduler.add_request(request)

    def abort(self, rid: str) -> None:
        self.scheduler.abort(rid)

    def flush_cache(self, call_id: int) -> ControlReply | None:
        """Drop every cached prefix but the pinned ones; refused (`flushed` False) while
        requests are queued or running. In the virtual layout a flush is answered through
        `outbox`, once the worker has released its views (None now)."""
        flushed = self.scheduler.flush_cache()
        if flushed and self.scheduler.config.kv_layout == "virtual":
            self.worker_calls.release_views(call_id)
            return None
        return ControlReply(call_id, {"flushed": flushed})

    def stats(self) -> dict[str, Any]:
        info = self.info
        return {**self.scheduler.stats(), "forward_seconds_total": self.forward_seconds,
                "kv_pool_bytes": info.kv_pool_bytes, "page_size": info.page_size,
                "device": info.device, "dtype": info.dtype, **self.scheduler.loras.stats(),
                # the adapters in use, as vLLM's lora_requests_info labels them
                "lora_running": sorted({r.lora for r in self.scheduler.running if r.lora}),
                "lora_waiting": sorted({r.lora for r in self.scheduler.waiting if r.lora}),
                "steps_run_ahead": self.pipeline.run_ahead if self.pipeline else 0,
                "slow_steps": self.slow_steps, "longest_step_seconds": self.longest_step}

    # -- the router's view -------------------------------------------------------------
    def load(self) -> ReplicaLoad:
        """How busy the scheduler is. Requests count as sequences (each sample or beam,
        including samples still to fork from a queued prompt), as `max_queued_requests` and
        `max_running_requests` count them. `waiting_tokens`: what the queued sequences must
        still prefill (their whole context: a queued one holds no KV, and the part the
        cache will cover is only known when it is admitted); `running_tokens`: the KV the
        running ones hold (a running prompt's unprefilled rest is in neither)."""
        sched = self.scheduler
        waiting_requests = waiting_tokens = running_tokens = 0
        for r in sched.waiting:
            waiting_requests += r.group.queued_width
            waiting_tokens += r.to_compute
        for r in sched.running:
            running_tokens += r.kv.kv_len
        return ReplicaLoad(waiting_requests=waiting_requests,
                           running_requests=len(sched.running), waiting_tokens=waiting_tokens,
                           running_tokens=running_tokens)

    def take_cache_events(self, heartbeat: bool = False) -> CacheEvents | None:
        """The next CacheEvents: the page hashes that entered and left the tree since the
        previous one, and the load now. None when neither changed, unless `heartbeat`. Call
        it after each step, from the thread that runs the steps, with a scheduler made with
        `cache_events=True` (the tree's changes accumulate until taken)."""
        with self.lock:
            tree = self.scheduler.cache.radix_cache
            changed = tree.events.changed
            load = self.load()
            if not changed and load == self._reported_load and not heartbeat:
                return None
            changes = tree.take_events() if changed else TreeEvents([], [], False)
            self._reported_load = load
            self.event_seq += 1
            return CacheEvents(epoch=self.epoch, seq=self.event_seq,
                               page_size=self.scheduler.page_size, stored=changes.stored,
                               removed=changes.removed, cleared=changes.cleared, load=load,
                               blocks=changes.blocks)

    def cache_snapshot(self, blocks: bool = False) -> dict:
        """Every page hash in the tree now, for a subscriber that lost track (see
        CacheEvents): `seq` is the last CacheEvents made, so the subscriber applies those
        after it. Events it then gets may repeat what the snapshot already holds, which is
        harmless: each is a set operation whose result is the tree after that event.
        `load` is a ReplicaLoad (over RPC an array, as in CacheEvents: `msgspec.convert(
        snapshot["load"], ReplicaLoad)` reads it back). `blocks` (with `kv_events` on): the
        tree as vLLM's KV events instead of `hashes` (BlockEventLog.dump)."""
        sched = self.scheduler
        tree = sched.cache.radix_cache
        whole: dict[str, Any] = ({"blocks": tree.events.dump()}
                                 if blocks and isinstance(tree.events, BlockEventLog)
                                 else {"hashes": tree.page_hashes_in_tree()})
        return {"epoch": self.epoch, "seq": self.event_seq, "page_size": sched.page_size,
                **whole, "load": self.load()}

    @property
    def has_work(self) -> bool:
        """Something for `step` to do: requests, aborts, worker calls, a step in flight."""
        pipeline = self.pipeline
        return (self.scheduler.has_work or bool(self.worker_calls.queued)
                or pipeline is not None and pipeline.in_flight is not None)

    def wait_limit(self, idle: float | None) -> float | None:
        """How long (seconds) the loop may wait for a message before it steps again: 0 with
        work to do, at most COMPILE_POLL while a constraint compiles, else `idle` (None:
        until a message comes)."""
        if self.has_work:
            return 0.0
        constraints = self.scheduler.constraints
        if constraints is not None and constraints.pending:
            return COMPILE_POLL if idle is None else min(idle, COMPILE_POLL)
        return idle

    @overload
    def handle(self, msg: Control) -> ControlReply | None: ...
    @overload
    def handle(self, msg: SchedulerInput) -> RequestRejected | ControlReply | None: ...

    def handle(self, msg: SchedulerInput) -> RequestRejected | ControlReply | None:
        """One message of the scheduler process's inbox; returns its reply, if it has one
        now (see `_operations`)."""
        if isinstance(msg, TokenizedRequest):
            try:
                self.scheduler.add_request(msg)
            except OverloadedError as e:
                return RequestRejected(msg.rid, ErrorCode.OVERLOADED, str(e))
            except ValueError as e:
                return RequestRejected(msg.rid, ErrorCode.INVALID_REQUEST, str(e))
            return None
        return self._operations[type(msg.op)](msg)

    def _abort(self, msg: Control) -> None:
        self.abort(msg.op.rid)  # type: ignore[union-attr]

    def _pin(self, msg: Control) -> ControlReply | None:
        """Pin: answered at once when cached, else through `outbox` after the prefill of a
        request (max_new_tokens 0, a rid no client uses) that answers nobody."""
        assert isinstance(msg.op, PinCall) and msg.op.input_ids is not None
        prefill = TokenizedRequest(rid=mint_rid("pin"), input_ids=msg.op.input_ids,
                                   sampling=SamplingParams(max_new_tokens=0),
                                   namespace=msg.caller.namespace)
        return self.scheduler.pin(msg, prefill)

    # -- the step ---------------------------------------------------------------------
    def step(self) -> list[RequestUpdate]:
        """Run the queued worker calls (`WorkerCalls.run`), schedule one batch, run
        it, and return every request's progress. With overlap the batch is launched, and
        the one launched before it is folded in while it runs."""
        began = time.perf_counter()
        try:
            pipeline = self.pipeline
            in_flight = pipeline is not None and pipeline.in_flight is not None
            if self.worker_calls.queued:
                if pipeline is not None and in_flight:  # worker calls run with none in flight
                    return self._fold(pipeline.drain())
                self.worker_calls.run(self.worker.control)
            with self.lock:
                sched = self.scheduler
                batch, updates = sched.schedule()
                if batch is None and not updates and sched.waiting and not in_flight:
                    # Cannot happen by construction; never spin or leave callers waiting.
                    log.error("requests could not be scheduled; aborting them")
                    for req in sched.waiting:
                        sched.abort(req.rid)
            if pipeline is not None:
                return updates + self._fold(pipeline.advance(batch))
            if batch is None:
                return updates
            started = time.perf_counter()  # without overlap: run and waited for
            try:
                outcome: Outcome = self.worker.forward(batch.forward)
            except Exception as e:
                outcome = e
            self.forward_seconds += time.perf_counter() - started
            return updates + self._fold_in(batch, outcome)
        finally:  # a step past the bound is reported (`slow_steps`; a server's health)
            took = time.perf_counter() - began
            self.longest_step = max(self.longest_step, took)
            self.slow_steps += took > self.stall_seconds

    def _fold(self, steps: Iterator[tuple[ScheduledBatch, Outcome]]) -> list[RequestUpdate]:
        """Fold in each step's outcome (`_fold_in`). The worker's time is spent in iterating
        `steps`, not holding the lock."""
        updates: list[RequestUpdate] = []
        started = time.perf_counter()
        for batch, outcome in steps:
            self.forward_seconds += time.perf_counter() - started
            updates += self._fold_in(batch, outcome)
            started = time.perf_counter()
        return updates

    def _fold_in(self, batch: ScheduledBatch, outcome: Outcome) -> list[RequestUpdate]:
        """Fold in a step's result, or fail its requests if the worker failed it."""
        with self.lock:
            if isinstance(outcome, Exception):  # one bad step must not take the engine down
                log.error("forward step failed", exc_info=outcome)
                return self.scheduler.fail_batch(batch, f"internal error: {outcome!r}")
            return self.scheduler.process_result(batch, outcome)

    def close(self) -> None:
        """Stop for good: with a disk tier, write every cached prefix out and save the
        tree's index, so that a restart on the same directory resumes warm. Call from the
        thread that runs the steps, once they have stopped. The core holds no worker after
        (an Engine kept alive does not keep its model and pool)."""
        if self.pipeline is not None:
            self._fold(self.pipeline.drain())
        with self.lock:
            self.scheduler.grammars.close()
            last = self.scheduler.close()
        if last is not None:
            try:
                self.worker.forward(last)
            except Exception:  # what was on disk before is still named by the index
                log.exception("writing the cache to the disk tier at shutdown failed")
            with self.lock:
                self.scheduler.cache.save_index()
                self.scheduler.cache.release_store()
        self.pipeline = None
        self.worker = None  # type: ignore[assignment]
