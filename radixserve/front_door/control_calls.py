"""The control calls the front door has sent the scheduler (flush, stats, snapshots,
profiles, pins, adapters): each goes under a control id of the front door's, since two
callers may use the same call id, and its answer goes back to the caller that made it,
shaped for that caller where it asks (text for a cache summary, a tenant's view of the
stats). A scheduler that dies leaves every one unanswered: its callers get the error."""

from __future__ import annotations

from typing import Any, Callable, Generic, TypeVar

from radixserve.messages import ControlReply, ErrorReply, ResultReply
from radixserve.results.errors import ErrorCode

Peer = TypeVar("Peer")

Shape = Callable[[dict], Any]
"""What turns the scheduler's payload into the caller's answer."""


class ControlCalls(Generic[Peer]):
    def __init__(self) -> None:
        self.waiting: dict[int, tuple[Peer, int, Shape | None]] = {}
        """Each call the scheduler has yet to answer, by control id: its caller, the
        caller's call id, and its `Shape`, if any."""
        self._ids = 0

    def open(self, peer: Peer, call_id: int, shape: Shape | None = None) -> int:
        """The control id of a new call, whose answer goes to (`peer`, `call_id`)."""
        self._ids += 1
        self.waiting[self._ids] = (peer, call_id, shape)
        return self._ids

    def answer(self, msg: ControlReply) -> tuple[Peer, ResultReply | ErrorReply] | None:
        """Where the answer `msg` goes, and the reply to send there (a refusal is the
        caller's `invalid_request`); None when no call waits for it."""
        target = self.waiting.pop(msg.call_id, None)
        if target is None:
            return None
        peer, call_id, shape = target
        if msg.error is not None:
            return peer, ErrorReply(call_id, ErrorCode.INVALID_REQUEST, msg.error)
        return peer, ResultReply(call_id, msg.payload if shape is None else shape(msg.payload))

    def drop_all(self) -> list[tuple[Peer, int]]:
        """Forget every call waiting (the scheduler died); returns their callers."""
        callers = [(peer, call_id) for peer, call_id, _ in self.waiting.values()]
        self.waiting.clear()
        return callers
