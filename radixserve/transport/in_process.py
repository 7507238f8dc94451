"""Calls from the front door's own process (its HTTP server's thread), handed over without
a socket. Both ends are here: `InProcessCalls`, the front door's, and `LocalClient`, the
asyncio operations of `AsyncClient` for the caller.

The caller queues each call and wakes the front door's loop through a pipe that loop polls
beside its sockets; the front door runs its handlers on the call as on any client's and
hands each reply object back to the caller's event loop. No message crosses ZeroMQ and no
reply is encoded. Each call is still encoded and decoded once, on the caller's thread: the
handlers take calls as they come off the wire (typed, bounds checked, `decoded=True`), and
an HTTP caller gets the same answers, errors included (`frame_too_large`, `invalid_request`
naming the field), as an RPC caller.

The front door tells this caller's replies apart by `LOCAL_PEER`, a routing id no ZeroMQ
client can have: ids that begin with a zero byte are libzmq's own, and those are 5 bytes.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import weakref
from collections import deque
from typing import Any, Callable

import msgspec

from radixserve.client.aio import AsyncCalls, AsyncOperations
from radixserve.client.frames import encode_call
from radixserve.messages import AbortCall, ErrorReply, RpcCall, RpcReply
from radixserve.transport.replies import decode_call

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
        # Closed with the last reference, not when the front door stops: the HTTP thread
        # may still submit then, and a number closed early could name another file by then.
        weakref.finalize(self, _close, self.fd, self._wake_write)
        self.deliver: Callable[[Any], None] = lambda reply: None
        """Hands a reply to the caller's side (called on the front door's thread); the
        caller's `LocalTransport` sets it."""

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



def _close(*fds: int) -> None:
    for fd in fds:
        os.close(fd)


class LocalTransport(AsyncCalls):
    """The caller's end: calls go to the door's queue, replies come back on this loop."""

    def __init__(self, door: InProcessCalls, max_frame_bytes: int,
                 stream_backlog: int | None) -> None:
        super().__init__(None, max_frame_bytes, stream_backlog)
        self._door = door
        self._decoder = msgspec.msgpack.Decoder(RpcCall)
        self._loop: asyncio.AbstractEventLoop | None = None
        door.deliver = self._deliver

    def _deliver(self, reply: RpcReply) -> None:
        """On the front door's thread: the reply goes to the caller's loop."""
        assert self._loop is not None  # set by the call it answers
        try:
            self._loop.call_soon_threadsafe(self._on_reply, reply)
        except RuntimeError:  # the loop is closed: the HTTP server is gone, and its callers
            pass

    def _on_reply(self, reply: RpcReply) -> None:
        for call in self._route(reply):  # a lagging stream's aborts
            self._door.submit(call)

    async def _send(self, call: RpcCall) -> asyncio.Queue[RpcReply]:
        self._loop = asyncio.get_running_loop()
        checked = decode_call(self._decoder, encode_call(self._encoder, call,
                                                         self.max_frame_bytes))
        replies = self._waiting(call.call_id)
        if isinstance(checked, ErrorReply):
            replies.put_nowait(checked)
        else:
            self._door.submit(checked)
        return replies

    async def _post(self, calls: list[AbortCall]) -> None:
        for call in calls:
            self._door.submit(call)


class LocalClient(AsyncOperations):
    """The front door's operations for its own process's HTTP server: no timeout (the
    routes bound their own waits), and the door's key for calls no HTTP caller's key
    speaks for."""

    def __init__(self, door: InProcessCalls, *, max_frame_bytes: int,
                 stream_backlog: int | None) -> None:
        super().__init__(LocalTransport(door, max_frame_bytes, stream_backlog), door.key)
