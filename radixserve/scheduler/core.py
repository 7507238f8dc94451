"""The engine core: one step of serving (schedule, run the worker, fold the result in),
the one loop body that both the in-process `Engine` and the scheduler process drive.

It knows no sockets and no torch: the worker is anything with `forward(ForwardBatch) ->
ForwardResult` and `control(WorkerCall)` (the `Worker` itself in-process, a socket proxy in
the scheduler process).
Requests and control operations are typed methods, and `handle` maps the scheduler
process's typed messages onto them, so every message kind has exactly one meaning.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, ContextManager, Protocol

from radixserve.messages import (AbortRequest, CacheEvents, CacheInfoRequest,
                                 CacheSnapshotRequest, ControlReply, FlushCacheRequest,
                                 ForwardBatch, ForwardResult, PinRequest, ProfileRequest,
                                 ReleaseViewsRequest, RequestRejected, RequestUpdate,
                                 SchedulerInput, StatsRequest, TokenizedRequest, UnpinRequest,
                                 WorkerCall, WorkerInfo)
from radixserve.scheduler.scheduler import OverloadedError, Scheduler

log = logging.getLogger(__name__)


class ForwardRunner(Protocol):
    def forward(self, batch: ForwardBatch) -> ForwardResult: ...

    def control(self, call: WorkerCall) -> dict[str, Any]:
        """Run a control call between steps; raises ValueError when refused."""
        ...


class EngineCore:
    def __init__(self, scheduler: Scheduler, worker: ForwardRunner, info: WorkerInfo,
                 lock: ContextManager[Any] | None = None) -> None:
        self.scheduler, self.worker, self.info = scheduler, worker, info
        self.lock = lock if lock is not None else contextlib.nullcontext()
        """Held around the scheduler's bookkeeping, released while the worker computes (the
        Engine's callers queue requests meanwhile)."""
        self.forward_seconds = 0.0
        self._worker_calls: list[WorkerCall] = []
        """Control calls for the worker, which may be mid-step: run by `run_worker_calls`."""

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
                "device": info.device, "dtype": info.dtype}

    def take_cache_events(self, heartbeat: bool = False) -> CacheEvents | None:
        """What the tree and the load did since the last call (Scheduler.take_cache_events);
        call it after each step, from the thread that runs the steps."""
        with self.lock:
            return self.scheduler.take_cache_events(heartbeat)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._worker_calls)

    def run_worker_calls(self) -> list[ControlReply]:
        """Run the queued worker control calls and return their answers; call it between
        steps, from the thread that runs them (so a call never lands inside a step)."""
        with self.lock:
            calls, self._worker_calls = self._worker_calls, []
        replies = []
        for call in calls:
            if isinstance(call, ReleaseViewsRequest):  # the flush it answers happened
                try:
                    self.worker.control(call)
                except Exception:  # the views stay mapped (harmless); the loop must go on
                    log.exception("releasing the views after a flush failed")
                replies.append(ControlReply(call.call_id, {"flushed": True}))
                continue
            try:
                replies.append(ControlReply(call.call_id, self.worker.control(call)))
            except ValueError as e:
                replies.append(ControlReply(call.call_id, {}, error=str(e)))
        return replies

    def handle(self, msg: SchedulerInput) -> RequestRejected | ControlReply | None:
        """One message of the scheduler process's inbox; returns its reply, if it has one."""
        match msg:
            case TokenizedRequest():
                try:
                    self.submit(msg)
                except OverloadedError as e:
                    return RequestRejected(msg.rid, "overloaded", str(e))
                except ValueError as e:
                    return RequestRejected(msg.rid, "invalid_request", str(e))
            case AbortRequest():
                self.abort(msg.rid)
            case FlushCacheRequest():
                return self.flush_cache(msg.call_id)
            case StatsRequest():
                return ControlReply(msg.call_id, self.stats())
            case CacheSnapshotRequest():
                return ControlReply(msg.call_id, self.scheduler.cache_snapshot())
            case PinRequest():  # None: answered by take_control_replies after its prefill
                return self.scheduler.pin(msg)
            case UnpinRequest():
                return ControlReply(msg.call_id, self.scheduler.unpin(msg))
            case CacheInfoRequest():
                return ControlReply(msg.call_id, self.scheduler.cache_info(msg))
            case ProfileRequest():
                self._worker_calls.append(msg)
        return None

    @property
    def compiling(self) -> bool:
        """Some request waits for its output constraint to compile (`step` takes it up)."""
        return self.scheduler.compiling

    def take_rejections(self) -> list[RequestRejected]:
        """Requests refused after they were taken (their constraint did not compile); call
        it after each step."""
        with self.lock:
            return [RequestRejected(*rejected) for rejected in self.scheduler.take_rejections()]

    def take_control_replies(self) -> list[ControlReply]:
        """Answers that a step produced (pins whose prefill finished); call it after each
        step, from the thread that runs the steps."""
        with self.lock:
            return self.scheduler.take_control_replies()

    # -- the step ---------------------------------------------------------------------
    def step(self) -> list[RequestUpdate]:
        """Schedule one batch, run it, and return every request's progress."""
        with self.lock:
            sched = self.scheduler
            batch, updates = sched.schedule()
            if batch is None and not updates and sched.waiting:
                # Cannot happen by construction; never spin or leave callers waiting.
                log.error("requests could not be scheduled; aborting them")
                for req in sched.waiting:
                    sched.abort(req.rid)
        if batch is None:
            return updates
        started = time.perf_counter()
        try:
            result = self.worker.forward(batch.forward)
        except Exception as e:  # one bad step must not take the engine down
            log.exception("forward step failed")
            with self.lock:
                return updates + self.scheduler.fail_batch(batch, f"internal error: {e!r}")
        finally:
            self.forward_seconds += time.perf_counter() - started
        with self.lock:
            updates += self.scheduler.process_result(batch, result)
            self.scheduler.maybe_save_index()
            return updates

    def close(self) -> None:
        """Stop for good: with a disk tier, write every cached prefix out and save the
        tree's index, so that a restart on the same directory resumes warm. Call from the
        thread that runs the steps, once they have stopped."""
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
            self.scheduler.save_index()
            self.scheduler.release_store()
