"""How the front door knows that its children are alive: their exits, and the scheduler's
progress.

A child that exits makes its sentinel (a pidfd) readable; the front door's loop polls the
sentinels beside its sockets (`watch_children`), so a crash is seen at once and nothing is
polled while idle. A scheduler that is alive but stuck is seen by its silence: its loop
sends something after every step (the step's updates or its cache events) and a heartbeat
every second while idle (`CACHE_EVENTS_HEARTBEAT`), so no progress for
`scheduler_stall_seconds` means one step has run that long, in the scheduler's own work or
in the worker's. Meanwhile `/health` says `stalled` (503), so that a router sends new work
elsewhere; the scheduler counts such steps once they end (`slow_steps` in its stats).
Answers to control calls are no progress: the scheduler serves those while it waits for
the worker.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import zmq

from radixserve.results.errors import ErrorCode


class Children(Protocol):
    """What the front door needs of server/'s Supervisor: the children's socket `paths`, state
    and processes (`procs`: each has a `pid`, and a `sentinel`, a file descriptor readable
    once it has exited), the cache secret, and `check` (restarts a dead child, says why)."""

    cache_secret: bytes
    paths: Any
    state: str  # the front door sets "ok" when the scheduler is ready
    failure_code: ErrorCode
    procs: dict[str, Any]
    def check(self) -> str | None: ...


class SchedulerProgress:
    """When the scheduler last made progress, and whether it is overdue."""

    def __init__(self, stall_seconds: float) -> None:
        self.stall_seconds = stall_seconds
        self.at = time.monotonic()

    def made(self) -> None:
        self.at = time.monotonic()

    def health(self, ready: bool, state: str) -> str:
        """`ok`, `stalled` while a step has run past the bound, else the children's
        `state` (starting, restarting, dead)."""
        if not ready:
            return state
        return "stalled" if time.monotonic() - self.at > self.stall_seconds else "ok"


def watch_children(poller: zmq.Poller, procs: dict[str, Any], watched: list[int]) -> list[int]:
    """The children's sentinels, now in `poller` instead of those `watched` (all of which
    go first: a new child's may reuse an old one's number)."""
    for fd in watched:
        poller.unregister(fd)
    sentinels = [child.sentinel for child in procs.values()]
    for fd in sentinels:
        poller.register(fd, zmq.POLLIN)
    return sentinels
