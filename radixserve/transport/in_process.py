"""Calls from the front door's own process (its HTTP server's thread), handed over without
a socket: the caller queues each call, already decoded and checked as a frame would be
(`client.local`), and wakes the front door's loop through a pipe that loop polls beside its
sockets; the front door runs its handlers on the call as on any client's and hands each
reply object back (`reply`), which the caller's side routes to its event loop. Nothing is
encoded on the way back and no message crosses ZeroMQ.

The front door tells this caller's replies apart by `LOCAL_PEER`, a routing id no ZeroMQ
client can have: ids that begin with a zero byte are libzmq's own, and those are 5 bytes.
"""

from __future__ import annotations

import os
import secrets
from collections import deque
from typing import Any, Callable

LOCAL_PEER = b"\x00in-process"


class InProcessCalls:
    """The hand-off: `submit` from any thread, `take` and `reply` on the front door's."""

    def __init__(self) -> None:
        self.key = secrets.token_urlsafe(32)
        """The in-process caller's own credential: the default tenant's, never the
        operator's (`Tenants.add_internal_key`). Each HTTP caller's calls carry that
        caller's key instead; this one speaks for the server's own calls (model info)."""
        self._calls: deque[Any] = deque()
        self.fd, self._wake_write = os.pipe()
        """What the front door's poller waits on (readable: calls are queued)."""
        os.set_blocking(self.fd, False)
        os.set_blocking(self._wake_write, False)
        self._deliver: Callable[[Any], None] | None = None

    def connect(self, deliver: Callable[[Any], None]) -> None:
        """The caller's side: `deliver(reply)` is called on the front door's thread."""
        self._deliver = deliver

    def submit(self, call: Any) -> None:
        """Queue a decoded call for the front door and wake its loop (any thread)."""
        self._calls.append(call)
        try:
            os.write(self._wake_write, b"\0")
        except BlockingIOError:  # the pipe is full: the loop has been woken already
            pass

    def take(self) -> list[Any]:
        """The calls queued since the last look (the front door's thread). The pipe is
        drained first: a call queued after that wakes the loop again."""
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass
        calls = []
        while self._calls:
            calls.append(self._calls.popleft())
        return calls

    def reply(self, reply: Any) -> None:
        """Hand a reply to the caller's side (the front door's thread)."""
        if self._deliver is not None:
            self._deliver(reply)

    def close(self) -> None:
        os.close(self.fd)
        os.close(self._wake_write)
