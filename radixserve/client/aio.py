"""`AsyncClient`: the RPC operations for asyncio, over one socket and a reader task."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Generator, cast

import msgspec
import zmq
import zmq.asyncio

from radixserve.client.frames import DEFAULT_MAX_FRAME_BYTES, call_frames
from radixserve.client.link import CONNECT_TIMEOUT, Link
from radixserve.client.operations import Operations
from radixserve.client.replies import DISCONNECTED, ends_stream, result, stream_item
from radixserve.messages import (AbortCall, ChunkReply, ErrorReply, GenerateCall, RpcCall,
                                 RpcReply, decode)
from radixserve.results.errors import ErrorCode
from radixserve.results.generate import GenerateResult


class AsyncCalls:
    """The calls in flight of an asyncio transport, by `call_id`, each with its queue of
    replies; a subclass sends calls (`_send`, `_post`) and hands what comes back to
    `_route`. A stream whose reader lags past `stream_backlog` is ended with `slow_reader`
    and aborted."""

    def __init__(self, timeout: float | None, max_frame_bytes: int,
                 stream_backlog: int | None) -> None:
        """`timeout`: how long a call waits for each reply unless told (None: forever).
        `stream_backlog`: see `AsyncClient`."""
        self.timeout, self.max_frame_bytes = timeout, max_frame_bytes
        self.stream_backlog = stream_backlog
        self._pending: dict[int, asyncio.Queue[RpcReply]] = {}
        self._streams: dict[int, list[AbortCall]] = {}
        """Each stream in flight, by call_id: the calls that abort it (when it lags)."""
        self._encoder = msgspec.msgpack.Encoder()

    async def _send(self, call: RpcCall) -> asyncio.Queue[RpcReply]:
        """Send `call`: the queue its replies come to."""
        raise NotImplementedError

    async def _post(self, calls: list[AbortCall]) -> None:
        """Send calls whose answers nobody waits for."""
        raise NotImplementedError

    def _route(self, reply: RpcReply) -> list[AbortCall]:
        """Queue `reply` for its call; the calls to post when it ended a lagging stream."""
        target = self._pending.get(reply.call_id)
        if target is None:
            return []
        aborts = self._streams.get(reply.call_id)
        if (aborts is not None and self.stream_backlog is not None
                and target.qsize() >= self.stream_backlog):
            self._pending.pop(reply.call_id, None)  # what else comes for it is dropped
            del self._streams[reply.call_id]
            target.put_nowait(ErrorReply(reply.call_id, ErrorCode.SLOW_READER, (
                f"the stream was ended: its reader was too slow, and more than "
                f"{self.stream_backlog} chunks (AsyncClient's stream_backlog; the HTTP "
                f"server's --http-stream-backlog) waited for it")))
            return aborts
        target.put_nowait(reply)
        return []

    def _waiting(self, call_id: int) -> asyncio.Queue[RpcReply]:
        replies: asyncio.Queue[RpcReply] = asyncio.Queue()
        self._pending[call_id] = replies
        return replies

    async def _wait(self, call_id: int, replies: asyncio.Queue[RpcReply],
                    timeout: float | None) -> RpcReply:
        try:
            return await asyncio.wait_for(
                replies.get(), timeout if timeout is not None else self.timeout)
        except TimeoutError:
            raise TimeoutError(f"no reply to call {call_id} in time") from None

    async def request(self, call: RpcCall, timeout: float | None) -> RpcReply:
        """Send `call` and wait for its one reply."""
        replies = await self._send(call)
        try:
            return await self._wait(call.call_id, replies, timeout)
        finally:
            self._pending.pop(call.call_id, None)

    async def stream(self, call: GenerateCall, aborts: list[AbortCall], timeout: float | None,
                     typed: bool = False) -> AsyncGenerator[Any, None]:
        """Send a streamed call and yield its replies as `stream_item`s (each within
        `timeout`; `typed` as for `stream_item`); if the caller leaves before the last, send
        `aborts`."""
        self._streams[call.call_id] = aborts
        try:
            replies = await self._send(call)
        except BaseException:
            self._streams.pop(call.call_id, None)
            raise
        complete = False
        try:
            while not complete:
                reply = await self._wait(call.call_id, replies, timeout)
                complete = ends_stream(reply)
                yield stream_item(reply, typed)
        finally:
            self._pending.pop(call.call_id, None)
            self._streams.pop(call.call_id, None)
            if not complete:  # abandoned mid-stream: free its blocks
                await self._post(aborts)

    async def close(self) -> None:
        pass


class AsyncTransport(AsyncCalls):
    """One zmq DEALER socket; a reader task (started by the first call, in its loop)
    routes each reply by `call_id` to its caller's queue. If the connection drops, every
    waiting call gets a `disconnected` error."""

    def __init__(self, address: str, timeout: float | None, max_frame_bytes: int,
                 stream_backlog: int | None, connect_timeout: float = CONNECT_TIMEOUT) -> None:
        """`connect_timeout`: how long a call waits with nothing connected (`Link`)."""
        super().__init__(timeout, max_frame_bytes, stream_backlog)
        self.address = address
        self._link = Link(address, connect_timeout)
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._monitor = self._sock.get_monitor_socket(Link.EVENTS)
        self._sock.connect(address)
        self._decoder = msgspec.msgpack.Decoder(RpcReply)
        self._reader: asyncio.Task[None] | None = None

    async def _read(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        link = self._link
        while True:
            events = dict(await poller.poll(link.poll_ms(bool(self._pending))))
            why = DISCONNECTED if self._monitor in events and link.on_event(
                await self._monitor.recv_multipart()) else link.unreachable()
            if why is not None:
                for call_id, waiting in list(self._pending.items()):
                    waiting.put_nowait(ErrorReply(call_id, ErrorCode.DISCONNECTED, why))
            if self._sock in events:
                await self._post(self._route(decode(self._decoder, await self._sock.recv())))

    async def _send(self, call: RpcCall) -> asyncio.Queue[RpcReply]:
        frames = call_frames(self._encoder, call, self.max_frame_bytes)
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read())
        replies = self._waiting(call.call_id)
        await self._sock.send_multipart(frames)
        return replies

    async def _post(self, calls: list[AbortCall]) -> None:
        for call in calls:
            await self._sock.send_multipart(call_frames(self._encoder, call,
                                                        self.max_frame_bytes))

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()


class Stream:
    """A stream's chunks (`Operations.generate`), as an async iterator whose first step
    sends the call; awaiting it gives itself, so that `await client.generate(...,
    stream=True)` (as SGLang's and OpenAI's async clients have it) and `async for` over
    `client.generate(..., stream=True)` both read it. `aclose()` before the end aborts
    the stream's requests; so does dropping it."""

    def __init__(self, chunks: AsyncGenerator[dict[str, Any], None]) -> None:
        self._chunks = chunks

    def __await__(self) -> Generator[Any, None, Stream]:
        return self._itself().__await__()

    async def _itself(self) -> Stream:
        return self

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        await self._chunks.aclose()


class AsyncOperations(Operations[Awaitable[Any]]):
    """The operations for asyncio over a transport (`AsyncCalls`): every operation is
    awaited; `generate(..., stream=True)` gives a `Stream` of the chunks (awaited or not)."""

    def __init__(self, transport: AsyncCalls, api_key: str | None) -> None:
        super().__init__(api_key)
        self._transport = transport

    async def _call(self, call: RpcCall, timeout: float | None, field: str | None = None) -> Any:
        answer = result(await self._transport.request(call, timeout))
        return answer if field is None else answer[field]

    def _stream(self, call: GenerateCall, timeout: float | None) -> Stream:
        return Stream(self._transport.stream(call, self._stream_aborts(call), timeout))

    async def generate_call(self, call: GenerateCall) -> GenerateResult:
        """A generate call its caller built (the HTTP routes': typed, from a body), sent
        with this client's call id (and key, unless it carries one): its result as the
        struct that came, not SGLang's dict (the routes shape it for their API)."""
        answer = result(await self._transport.request(self._own(call), None), typed=True)
        assert isinstance(answer, GenerateResult)
        return answer

    def stream_call(self, call: GenerateCall) -> AsyncIterator[ChunkReply | GenerateResult]:
        """`generate_call` streamed: the `ChunkReply`s, then the `GenerateResult`."""
        call = self._own(call)
        return self._transport.stream(call, self._stream_aborts(call), None, typed=True)

    def _own(self, call: GenerateCall) -> GenerateCall:
        return msgspec.structs.replace(call, call_id=next(self._ids),
                                       api_key=self._key(call.api_key))

    def generate_stream(self, prompt: str | list[str] | None = None,
                        sampling_params: dict | list[dict] | None = None,
                        input_ids: list[int] | list[list[int]] | None = None,
                        **options: Any) -> Stream:
        """`generate(..., stream=True)`: its chunks, without the await. `options`: those
        of `generate`."""
        return cast(Stream, self.generate(prompt, sampling_params, input_ids, stream=True,
                                          **options))

    async def close(self) -> None:
        await self._transport.close()


class AsyncClient(AsyncOperations):
    """The RPC client for asyncio (see `radixserve.api.AsyncApi`)."""

    def __init__(self, address: str, timeout: float | None = 600.0,
                 api_key: str | None = None, *,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 stream_backlog: int | None = None,
                 connect_timeout: float = CONNECT_TIMEOUT) -> None:
        """`timeout`, `api_key`, `max_frame_bytes` and `connect_timeout` as for `Client`.
        `stream_backlog`: chunks held for a stream whose reader lags; past it the stream is
        aborted and ends with ServerError `slow_reader` (None: no bound)."""
        self._zmq = AsyncTransport(address, timeout, max_frame_bytes, stream_backlog,
                                   connect_timeout)
        super().__init__(self._zmq, api_key)

    @property
    def address(self) -> str:
        return self._zmq.address

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
