"""Calls from the front door's own process (its HTTP server's thread), handed over without
a socket. Both ends are here: `InProcessCalls`, the front door's, and `LocalClient`, the
HTTP routes' client.

The caller queues each call with the sink its replies go to (`ReplySink`) and wakes the
front door's loop through a pipe that loop polls beside its sockets; the front door runs
its handlers on the call as on any client's and answers the sink the call came with, as it
answers a socket's client by its routing id. No message crosses ZeroMQ and no reply is
encoded.

A generate call goes as the routes built it (`LocalClient.generate_call`, `stream_call`):
a typed `GenerateCall` whose fields were decoded from the HTTP body (or converted from the
OpenAI routes' values, checked alike), answered on a sink of its own (`LocalReplies`).
The other calls (model info, stats, aborts, pins, adapters) are built by `AsyncOperations`
from Python values, as an RPC client's are, so each is encoded and decoded once on the
caller's thread (typed, bounds checked: `decode_call`) before the front door takes it.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import weakref
from collections import deque
from typing import Any, AsyncIterator, Protocol

import msgspec

from radixserve.client.aio import AsyncCalls, AsyncOperations
from radixserve.client.frames import encode_call
from radixserve.messages import (AbortCall, ChunkReply, ErrorReply, GenerateCall, RpcCall,
                                 RpcReply)
from radixserve.results.errors import ErrorCode, ServerError
from radixserve.results.generate import GenerateResult
from radixserve.transport.replies import decode_call


class ReplySink(Protocol):
    """Where the front door sends an in-process call's replies (on its own thread)."""

    def put(self, reply: RpcReply) -> bool:
        """Take `reply`; False when the caller takes no more (its calls are then aborted)."""


class InProcessCalls:
    """The hand-off: `submit` from any thread, `take` on the front door's."""

    def __init__(self) -> None:
        self.key = secrets.token_urlsafe(32)
        """The in-process caller's own credential: the default tenant's, never the
        operator's (`Tenants.add_internal_key`). Each HTTP caller's calls carry that
        caller's key instead; this one speaks for the server's own calls (model info)."""
        self._calls: deque[tuple[Any, ReplySink]] = deque()
        self.fd, self._wake_write = os.pipe()
        """What the front door's poller waits on (readable: calls are queued)."""
        os.set_blocking(self.fd, False)
        os.set_blocking(self._wake_write, False)
        # Closed with the last reference, not when the front door stops: the HTTP thread
        # may still submit then, and a number closed early could name another file by then.
        weakref.finalize(self, _close, self.fd, self._wake_write)

    def submit(self, call: Any, sink: ReplySink) -> None:
        """Queue a typed call, answered on `sink`, and wake the front door's loop (any
        thread)."""
        self._calls.append((call, sink))
        try:
            os.write(self._wake_write, b"\0")
        except BlockingIOError:  # the pipe is full: the loop has been woken already
            pass

    def take(self) -> list[tuple[Any, ReplySink]]:
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


class LocalReplies:
    """One generate call's replies, from the front door's thread to the caller's event loop
    (made on that loop). A stream whose reader lags `backlog` replies behind ends with
    `slow_reader` instead, and the front door aborts its requests: its HTTP reader may not
    read at all, so nothing on the loop's side would notice."""

    def __init__(self, backlog: int | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[RpcReply] = asyncio.Queue()
        self._backlog = backlog
        self._ended = False
        # Each counter is written by one thread only (put's, get's): their difference is
        # what waits, replies still on their way to the loop included.
        self._sent = self._read = 0

    def put(self, reply: RpcReply) -> bool:
        if self._ended:
            return False
        self._sent += 1
        if self._backlog is not None and self._sent - self._read > self._backlog:
            self._ended = True
            reply = ErrorReply(reply.call_id, ErrorCode.SLOW_READER, (
                f"the stream was ended: its reader was too slow, and more than "
                f"{self._backlog} chunks (the HTTP server's --http-stream-backlog) waited "
                "for it"))
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, reply)
        except RuntimeError:  # the loop is closed: the HTTP server is gone, and its callers
            return False
        return not self._ended

    async def get(self) -> ChunkReply | GenerateResult:
        """The next chunk, or the result; an error raised as ServerError."""
        reply = await self._queue.get()
        self._read += 1
        if isinstance(reply, ErrorReply):
            raise ServerError(reply.code, reply.message)
        if isinstance(reply, ChunkReply):
            return reply
        assert isinstance(reply.result, GenerateResult)  # a generate call's answer
        return reply.result


class LocalTransport(AsyncCalls):
    """The other calls' end: checked as a socket would, then queued for the door; their
    replies come back on this loop, routed by call id."""

    def __init__(self, door: InProcessCalls, max_frame_bytes: int,
                 stream_backlog: int | None) -> None:
        super().__init__(None, max_frame_bytes, stream_backlog)
        self._door = door
        self._decoder = msgspec.msgpack.Decoder(RpcCall)
        self._loop: asyncio.AbstractEventLoop | None = None

    def put(self, reply: RpcReply) -> bool:
        """On the front door's thread: the reply goes to the caller's loop."""
        assert self._loop is not None  # set by the call it answers
        try:
            self._loop.call_soon_threadsafe(self._on_reply, reply)
        except RuntimeError:  # the loop is closed: the HTTP server is gone, and its callers
            pass
        return True

    def _on_reply(self, reply: RpcReply) -> None:
        for call in self._route(reply):  # a lagging stream's aborts
            self._door.submit(call, self)

    async def _send(self, call: RpcCall) -> asyncio.Queue[RpcReply]:
        self._loop = asyncio.get_running_loop()
        checked = decode_call(self._decoder, encode_call(self._encoder, call,
                                                         self.max_frame_bytes))
        replies = self._waiting(call.call_id)
        if isinstance(checked, ErrorReply):
            replies.put_nowait(checked)
        else:
            self._door.submit(checked, self)
        return replies

    async def _post(self, calls: list[AbortCall]) -> None:
        for call in calls:
            self._door.submit(call, self)


class LocalClient(AsyncOperations):
    """The front door's operations for its own process's HTTP server: no timeout (the
    routes bound their own waits), and the door's key for calls no HTTP caller's key
    speaks for."""

    def __init__(self, door: InProcessCalls, *, max_frame_bytes: int,
                 stream_backlog: int | None) -> None:
        super().__init__(LocalTransport(door, max_frame_bytes, stream_backlog), door.key)
        self._door, self._stream_backlog = door, stream_backlog

    async def generate_call(self, call: GenerateCall) -> GenerateResult:
        replies = LocalReplies()
        self._door.submit(call, replies)
        result = await replies.get()
        assert isinstance(result, GenerateResult)  # a plain call is never answered in chunks
        return result

    async def stream_call(self, call: GenerateCall
                          ) -> AsyncIterator[ChunkReply | GenerateResult]:
        replies = LocalReplies(self._stream_backlog)
        self._door.submit(call, replies)
        item = await replies.get()
        while isinstance(item, ChunkReply):
            yield item
            item = await replies.get()
        yield item
