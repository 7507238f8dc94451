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
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any, Callable, ContextManager, Protocol, cast, overload

import msgspec

from radixserve.messages import (AbortCall, CacheEvents, CacheInfoCall, CacheSnapshotCall,
                                 Control, ControlReply, FlushCacheCall, ForwardBatch,
                                 ForwardResult, LoadLoraCall, LoadLoraRequest, LoraInfo,
                                 LorasCall, PinCall, ProfileCall, ReleaseViewsRequest,
                                 RequestRejected, RequestUpdate, SamplingParams, SchedulerInput,
                                 StatsCall, TokenizedRequest, UnloadLoraCall, UnloadLoraRequest,
                                 UnpinCall, WorkerCall, WorkerInfo)
from radixserve.results.errors import ErrorCode
from radixserve.rids import mint_rid
from radixserve.scheduler.scheduled import ScheduledBatch
from radixserve.scheduler.overlap import Outcome, Pipeline, StepRunner
from radixserve.scheduler.scheduler import OverloadedError, Scheduler

log = logging.getLogger(__name__)


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
        self.pipeline = Pipeline(worker) if scheduler.overlap is not None else None
        """With overlap scheduling, the step in flight on the worker."""
        self._worker_calls: list[WorkerCall] = []
        """Control calls for the worker, which may be mid-step: run by `run_worker_calls`."""
        cache, answer = self.scheduler.cache, _answer
        self._operations: dict[type, Callable[[Control], ControlReply | None]] = {
            AbortCall: self._abort,
            FlushCacheCall: lambda msg: self.flush_cache(msg.call_id),
            StatsCall: answer(lambda msg: self.stats()),
            CacheSnapshotCall: answer(lambda msg: cache.cache_snapshot()),
            PinCall: self._pin,
            # The key is the type of `msg.op`, which a lambda cannot declare: hence the casts.
            UnpinCall: answer(lambda msg: cache.unpin(cast(UnpinCall, msg.op), msg.caller)),
            CacheInfoCall: answer(lambda msg: cache.cache_info(cast(CacheInfoCall, msg.op).top,
                                                               msg.caller.scope)),
            ProfileCall: self._queue_profile,
            LoadLoraCall: self._load_lora,
            UnloadLoraCall: self._unload_lora,
            LorasCall: answer(lambda msg: {"loras": self.scheduler.loras.describe(
                operator=msg.caller.scope.prefix is None)})}
        """What each control operation does, by its type: its answer now, or None (an
        abort has none, a profile's and a virtual layout's flush's come from
        `run_worker_calls`, a pin's may come from `take_control_replies` after its
        prefill)."""

    # -- requests and control ---------------------------------------------------------
    def submit(self, request: TokenizedRequest) -> None:
        """Queue a request; raises ValueError (invalid here) or OverloadedError (queue full)."""
        self.scheduler.add_request(request)

    def abort(self, rid: str) -> None:
        self.scheduler.abort(rid)

    def flush_cache(self, call_id: int) -> ControlReply | None:
        """Drop every cached prefix but the pinned ones; refused (`flushed` False) while
        requests are queued or running. In the virtual layout a flush is answered by
        `run_worker_calls`, once the worker has released its views (None now)."""
        flushed = self.scheduler.flush_cache()
        if flushed and self.scheduler.config.kv_layout == "virtual":
            self._worker_calls.append(ReleaseViewsRequest(call_id))
            return None
        return ControlReply(call_id, {"flushed": flushed})

    def stats(self) -> dict[str, Any]:
        info = self.info
        return {**self.scheduler.stats(), "forward_seconds_total": self.forward_seconds,
                "kv_pool_bytes": info.kv_pool_bytes, "page_size": info.page_size,
                "device": info.device, "dtype": info.dtype, **self.scheduler.loras.stats(),
                "steps_run_ahead": self.pipeline.run_ahead if self.pipeline else 0}

    def take_cache_events(self, heartbeat: bool = False) -> CacheEvents | None:
        """What the tree and the load did since the last call (CacheService.take_cache_events);
        call it after each step, from the thread that runs the steps."""
        with self.lock:
            return self.scheduler.cache.take_cache_events(heartbeat)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._worker_calls) or self._in_flight

    @property
    def _in_flight(self) -> bool:
        return self.pipeline is not None and self.pipeline.in_flight is not None

    def run_worker_calls(self) -> list[ControlReply]:
        """Run the queued worker control calls and return their answers; call it between
        steps, from the thread that runs them (so a call never lands inside a step). With a
        step in flight they wait: the next `step` folds it and launches none."""
        if self._in_flight:
            return []
        with self.lock:
            calls, self._worker_calls = self._worker_calls, []
        replies = []
        for call in calls:
            if isinstance(call, LoadLoraRequest):
                replies.append(self._answer_load(call))
                continue
            if isinstance(call, ReleaseViewsRequest):  # the flush it answers happened
                try:
                    released = self.worker.control(call)
                    if self.scheduler.maps:
                        self.scheduler.maps.in_use = released.get("kv_mappings", 0)
                except Exception:  # the views stay mapped (harmless); the loop must go on
                    log.exception("releasing the views after a flush failed")
                replies.append(ControlReply(call.call_id, {"flushed": True}))
                continue
            try:
                replies.append(ControlReply(call.call_id, self.worker.control(call)))
            except ValueError as e:
                replies.append(ControlReply(call.call_id, {}, error=str(e)))
        return replies

    @overload
    def handle(self, msg: Control) -> ControlReply | None: ...
    @overload
    def handle(self, msg: SchedulerInput) -> RequestRejected | ControlReply | None: ...

    def handle(self, msg: SchedulerInput) -> RequestRejected | ControlReply | None:
        """One message of the scheduler process's inbox; returns its reply, if it has one
        now (see `_operations`)."""
        if isinstance(msg, TokenizedRequest):
            try:
                self.submit(msg)
            except OverloadedError as e:
                return RequestRejected(msg.rid, ErrorCode.OVERLOADED, str(e))
            except ValueError as e:
                return RequestRejected(msg.rid, ErrorCode.INVALID_REQUEST, str(e))
            return None
        return self._operations[type(msg.op)](msg)

    def _abort(self, msg: Control) -> None:
        self.abort(msg.op.rid)  # type: ignore[union-attr]

    def _queue_profile(self, msg: Control) -> None:
        """Answered by `run_worker_calls`, under the control call's id."""
        assert isinstance(msg.op, ProfileCall)
        self._worker_calls.append(msgspec.structs.replace(msg.op, call_id=msg.call_id))

    def _adapters_in_use(self) -> set[str | None]:
        return {group.leader.lora for group in self.scheduler.groups.values()}

    def _load_lora(self, msg: Control) -> ControlReply | None:
        """Answered by `run_worker_calls` once the worker has read the adapter (now when
        refused: see `LoraRegistry.begin_load`)."""
        op = cast(LoadLoraCall, msg.op)
        try:
            drop = self.scheduler.loras.begin_load(op.lora_name, self._adapters_in_use())
        except ValueError as e:
            return ControlReply(msg.call_id, {}, error=str(e))
        self._worker_calls.append(LoadLoraRequest(msg.call_id, op.lora_name, op.lora_path, drop))
        return None

    def _answer_load(self, call: LoadLoraRequest) -> ControlReply:
        try:
            info = LoraInfo(**self.worker.control(call))
        except ValueError as e:
            with self.lock:
                self.scheduler.loras.end_load(call.name, None)
            return ControlReply(call.call_id, {}, error=str(e))
        with self.lock:
            self.scheduler.loras.end_load(call.name, info)
        answer: dict[str, Any] = {**msgspec.structs.asdict(info), "unloaded": call.drop}
        return ControlReply(call.call_id, answer)

    def _unload_lora(self, msg: Control) -> ControlReply | None:
        """Answered by `run_worker_calls` once the worker has dropped the adapter."""
        name = cast(UnloadLoraCall, msg.op).lora_name
        try:
            self.scheduler.loras.unload(name, self._adapters_in_use())
        except ValueError as e:
            return ControlReply(msg.call_id, {}, error=str(e))
        self._worker_calls.append(UnloadLoraRequest(msg.call_id, name))
        return None

    def _pin(self, msg: Control) -> ControlReply | None:
        """Pin: answered at once when cached, else by `take_control_replies` after the
        prefill of a request (max_new_tokens 0, a rid no client uses) that answers nobody."""
        assert isinstance(msg.op, PinCall) and msg.op.input_ids is not None
        prefill = TokenizedRequest(rid=mint_rid("pin"), input_ids=msg.op.input_ids,
                                   sampling=SamplingParams(max_new_tokens=0),
                                   namespace=msg.caller.namespace)
        return self.scheduler.pin(msg, prefill)

    @property
    def compiling(self) -> bool:
        """Some request waits for its output constraint to compile (`step` takes it up)."""
        return bool(self.scheduler.constraints.pending)

    def take_rejections(self) -> list[RequestRejected]:
        """Requests refused after they were taken (their constraint did not compile); call
        it after each step."""
        with self.lock:
            rejected = self.scheduler.constraints.take_rejections()
            return [RequestRejected(*r) for r in rejected]

    def take_control_replies(self) -> list[ControlReply]:
        """Answers that a step produced (pins whose prefill finished); call it after each
        step, from the thread that runs the steps."""
        with self.lock:
            return self.scheduler.cache.take_control_replies()

    # -- the step ---------------------------------------------------------------------
    def step(self) -> list[RequestUpdate]:
        """Schedule one batch, run it, and return every request's progress. With overlap
        the batch is launched, and the one launched before it is folded in while it runs."""
        pipeline = self.pipeline
        if pipeline is not None and pipeline.in_flight is not None and self._worker_calls:
            return self._fold(pipeline.drain())  # the worker's calls run with none in flight
        with self.lock:
            sched = self.scheduler
            batch, updates = sched.schedule()
            if batch is None and not updates and sched.waiting and not self._in_flight:
                # Cannot happen by construction; never spin or leave callers waiting.
                log.error("requests could not be scheduled; aborting them")
                for req in sched.waiting:
                    sched.abort(req.rid)
        if pipeline is not None:
            return updates + self._fold(pipeline.advance(batch))
        return updates + self._fold(self._run(batch))

    def _run(self, batch: ScheduledBatch | None) -> Iterator[tuple[ScheduledBatch, Outcome]]:
        """Without overlap: `batch` run on the worker and waited for."""
        if batch is None:
            return
        try:
            outcome: Outcome = self.worker.forward(batch.forward)
        except Exception as e:
            outcome = e
        yield batch, outcome

    def _fold(self, steps: Iterator[tuple[ScheduledBatch, Outcome]]) -> list[RequestUpdate]:
        """Fold in each step's result, or fail its requests if the worker failed it. The
        worker's time is spent in iterating `steps`, not holding the lock."""
        updates: list[RequestUpdate] = []
        started = time.perf_counter()
        for batch, outcome in steps:
            self.forward_seconds += time.perf_counter() - started
            with self.lock:
                if isinstance(outcome, Exception):  # one bad step must not take the engine down
                    log.error("forward step failed", exc_info=outcome)
                    updates += self.scheduler.fail_batch(batch, f"internal error: {outcome!r}")
                else:
                    updates += self.scheduler.process_result(batch, outcome)
            started = time.perf_counter()
        return updates

    def close(self) -> None:
        """Stop for good: with a disk tier, write every cached prefix out and save the
        tree's index, so that a restart on the same directory resumes warm. Call from the
        thread that runs the steps, once they have stopped."""
        if self.pipeline is not None:
            self._fold(self.pipeline.drain())
        with self.lock:
            self.scheduler.grammars.close()
            last = self.scheduler.close()
        if last is None:
            return
        try:
            self.worker.forward(last)
        except Exception:  # what was on disk before is still named by the index
            log.exception("writing the cache to the disk tier at shutdown failed")
        with self.lock:
            self.scheduler.cache.save_index()
            self.scheduler.cache.release_store()
