"""Control calls for the worker: a profile, an adapter's load or unload, the views'
release after a flush in the virtual layout. The control operations that need one queue
it here; `EngineCore.step` runs the queue only between steps, with none in flight (so a
call never lands inside a step), and each answer goes through the scheduler's `outbox`
under its call's id. An adapter's load and unload are the scheduler's bookkeeping too:
its registry (`LoraRegistry`) learns what the worker did."""

from __future__ import annotations

import logging
from typing import Any, Callable, ContextManager, cast

import msgspec

from radixserve.messages import (Control, ControlReply, LoadLoraCall, LoadLoraRequest, LoraInfo,
                                 ProfileCall, ReleaseViewsRequest, UnloadLoraCall,
                                 UnloadLoraRequest, WorkerCall)
from radixserve.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)

Run = Callable[[WorkerCall], dict[str, Any]]
"""The worker's `control`: runs a call, raises ValueError when refused."""


class WorkerCalls:
    def __init__(self, scheduler: Scheduler, lock: ContextManager[Any]) -> None:
        self.scheduler, self.lock = scheduler, lock
        self.queued: list[WorkerCall] = []
        """Calls for the worker, which may be mid-step: run by the next step that finds no
        step in flight (`run`)."""

    def profile(self, msg: Control) -> None:
        """Answered once the worker has run it, under the call's id."""
        assert isinstance(msg.op, ProfileCall)
        self.queued.append(msgspec.structs.replace(msg.op, call_id=msg.call_id))

    def release_views(self, call_id: int) -> None:
        """After a flush in the virtual layout: the flush is answered once the worker has
        released its views."""
        self.queued.append(ReleaseViewsRequest(call_id))

    def load_lora(self, msg: Control) -> ControlReply | None:
        """Answered once the worker has read the adapter (now when refused: see
        `LoraRegistry.begin_load`)."""
        op = cast(LoadLoraCall, msg.op)
        in_use = {group.seqs[0].lora for group in self.scheduler.groups.values()}
        try:
            drop = self.scheduler.loras.begin_load(op.lora_name, in_use)
        except ValueError as e:
            return ControlReply(msg.call_id, {}, error=str(e))
        self.queued.append(LoadLoraRequest(msg.call_id, op.lora_name, op.lora_path, drop))
        return None

    def unload_lora(self, msg: Control) -> ControlReply | None:
        """Answered once the worker has dropped the adapter. The requests that use it end
        first (at the start of the next step, with an abort naming the unload), so the
        operator's unload takes effect within a step, in use or not."""
        name = cast(UnloadLoraCall, msg.op).lora_name
        try:
            self.scheduler.loras.unload(name)
        except ValueError as e:
            return ControlReply(msg.call_id, {}, error=str(e))
        reason = {"type": "abort", "message": f"the operator unloaded LoRA adapter {name!r}"}
        for rid, group in self.scheduler.groups.items():
            if group.seqs[0].lora == name:
                self.scheduler.abort(rid, reason)
        self.queued.append(UnloadLoraRequest(msg.call_id, name))
        return None

    def run(self, control: Run) -> None:
        """Run the queued calls on the worker (`control`), their answers to `outbox`; only
        between steps, with none in flight."""
        with self.lock:
            calls, self.queued = self.queued, []
        replies = []
        for call in calls:
            if isinstance(call, LoadLoraRequest):
                replies.append(self._answer_load(control, call))
                continue
            if isinstance(call, ReleaseViewsRequest):  # the flush it answers happened
                try:
                    released = control(call)
                    if self.scheduler.maps:
                        self.scheduler.maps.in_use = released.get("kv_mappings", 0)
                except Exception:  # the views stay mapped (harmless); the loop must go on
                    log.exception("releasing the views after a flush failed")
                replies.append(ControlReply(call.call_id, {"flushed": True}))
                continue
            try:
                replies.append(ControlReply(call.call_id, control(call)))
            except ValueError as e:
                replies.append(ControlReply(call.call_id, {}, error=str(e)))
        with self.lock:
            self.scheduler.outbox.extend(replies)

    def _answer_load(self, control: Run, call: LoadLoraRequest) -> ControlReply:
        try:
            info = LoraInfo(**control(call))
        except ValueError as e:
            with self.lock:
                self.scheduler.loras.end_load(call.name, None)
            return ControlReply(call.call_id, {}, error=str(e))
        with self.lock:
            self.scheduler.loras.end_load(call.name, info)
        answer: dict[str, Any] = {**msgspec.structs.asdict(info), "unloaded": call.drop}
        return ControlReply(call.call_id, answer)
