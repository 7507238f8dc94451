"""`LocalClient`: the asyncio operations of `AsyncClient` for a caller in the front door's
own process (its HTTP server), over `transport.in_process` instead of a socket.

Each call is still encoded and decoded once, here on the caller's thread: the front door's
handlers take calls as they come off the wire (typed, bounds checked, `decoded=True`), and
a caller gets the same answers, errors included (`frame_too_large`, `invalid_request`
naming the field), as over RPC. Replies come back as objects, routed on the caller's event
loop."""

from __future__ import annotations

import asyncio
import msgspec

from radixserve.client.aio import AsyncCalls, AsyncOperations
from radixserve.client.frames import encode_call
from radixserve.messages import AbortCall, ErrorReply, RpcCall, RpcReply
from radixserve.transport.in_process import InProcessCalls
from radixserve.transport.replies import decode_call


class LocalTransport(AsyncCalls):
    def __init__(self, door: InProcessCalls, max_frame_bytes: int,
                 stream_backlog: int | None) -> None:
        super().__init__(None, max_frame_bytes, stream_backlog)
        self._door = door
        self._decoder = msgspec.msgpack.Decoder(RpcCall)
        self._loop: asyncio.AbstractEventLoop | None = None
        door.connect(self._deliver)

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
