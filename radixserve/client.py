"""RPC clients of a radixserve server: `Client` (threads) and `AsyncClient` (asyncio).

Both speak the msgpack schema of `radixserve.messages` (GenerateCall ... / ResultReply,
ChunkReply, ErrorReply) over one zmq DEALER socket, and match replies to calls by
`call_id`, so many calls can be in flight at once on one client.

`api_key`: the caller's key (its tenant token) on a server started with `--api-key`; sent
with every call. `generate(..., cache_salt=...)` narrows the cache namespace further.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import uuid
from typing import Any, AsyncIterator, Iterator

import msgspec
import zmq
import zmq.asyncio

from radixserve.messages import (AbortCall, CacheInfoCall, CacheSnapshotCall, ChunkReply,
                                 ErrorReply, FlushCacheCall, GenerateCall, HealthCall,
                                 ModelInfoCall, PinCall, ProfileCall, ResultReply, RpcReply,
                                 StatsCall, UnpinCall, WorkersCall, beam_arguments)
from radixserve.results.errors import ServerError
from radixserve.results.generate import GenerateResult
from radixserve.results.sglang import sglang_result


DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024
"""The server's `max_frame_bytes` unless told otherwise (`ServerConfig.max_frame_bytes`)."""
DISCONNECTED = ("the connection to the server dropped, and calls in flight on it get no "
                "answer (the server drops a connection whose frame exceeds its "
                "max_frame_bytes, or it restarted)")


def _encode_call(encoder: msgspec.msgpack.Encoder, call: Any, limit: int) -> bytes:
    """A call as a frame, refused here when the server would drop it unread, or when it
    cannot be one (an int past msgpack's 64 bits, which a JSON body over HTTP may hold)."""
    try:
        frame = encoder.encode(call)
    except OverflowError as e:
        raise ServerError("invalid_request", f"the call holds an integer outside [-2**63, "
                          f"2**64 - 1], which no parameter takes ({e})") from None
    if len(frame) > limit:
        raise ServerError("frame_too_large", f"the call is a frame of {len(frame)} bytes, more "
                          f"than the server's max_frame_bytes={limit} (--max-frame-bytes), "
                          "which ZeroMQ enforces by dropping the connection unread")
    return frame


def _generate_call(call_id: int, prompt: Any, input_ids: Any, stream: bool, rid: Any,
                   kwargs: dict[str, Any]) -> GenerateCall:
    if stream and rid is None:  # a stream abandoned mid-way is aborted by rid
        batch = prompt if isinstance(prompt, list) else (
            input_ids if isinstance(input_ids, list) and input_ids
            and isinstance(input_ids[0], list) else None)
        rid = ([f"stream-{uuid.uuid4().hex}" for _ in batch] if batch is not None
               else f"stream-{uuid.uuid4().hex}")
    return GenerateCall(call_id=call_id, text=prompt, input_ids=input_ids, stream=stream,
                        rid=rid, **kwargs)


def answer(reply: ResultReply | ChunkReply, typed: bool = False) -> Any:
    """What a caller gets for a reply: a generate call's result in SGLang's dict shape
    (`results.sglang.sglang_result`, the documented contract), a stream's chunk as
    `{"index", "text", "token_ids"}`, a control call's answer as it came. `typed` (the
    HTTP server's client): the generate result and chunks as they came, the structs its
    routes read."""
    if typed and isinstance(reply, ChunkReply):
        return reply
    if isinstance(reply, ChunkReply):
        return {"index": reply.index, "text": reply.text, "token_ids": reply.token_ids}
    result = reply.result
    if not isinstance(result, GenerateResult) or typed:
        return result
    return sglang_result(result)


def _stream_item(reply: ResultReply | ChunkReply, typed: bool) -> Any:
    """A stream's item: a chunk, or the final result (`{"final": result}` unless typed)."""
    item = answer(reply, typed)
    return item if typed or isinstance(reply, ChunkReply) else {"final": item}


def _rids(rid: str | list[str]) -> list[str]:
    return [rid] if isinstance(rid, str) else list(rid)


class Client:
    """Thread-safe: a background thread owns the socket; callers wait on their own queue."""

    typed = False
    """See `answer`."""

    def __init__(self, address: str, timeout: float | None = 600.0,
                 api_key: str | None = None, *,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        """`api_key`: the caller's key when the server has keys (it names the tenant).
        `max_frame_bytes`: the server's limit; a larger call raises ServerError
        `frame_too_large` here rather than lose the connection. If the connection drops
        anyway, calls in flight fail with `disconnected`."""
        self.address, self.timeout, self.api_key = address, timeout, api_key
        self.max_frame_bytes = max_frame_bytes
        self._ctx = zmq.Context()
        self._ids = itertools.count(1)
        self._pending: dict[int, queue.Queue] = {}
        self._lock = threading.Lock()
        self._outgoing: queue.Queue[bytes | None] = queue.Queue()
        self._encoder = msgspec.msgpack.Encoder()
        self._wake = f"inproc://client-{uuid.uuid4().hex}"
        waker = self._ctx.socket(zmq.PULL)
        waker.bind(self._wake)
        self._thread = threading.Thread(target=self._io, args=(waker,), daemon=True)
        self._thread.start()
        self._poke = self._ctx.socket(zmq.PUSH)
        self._poke.connect(self._wake)

    def _io(self, waker: zmq.Socket) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(self.address)
        decoder = msgspec.msgpack.Decoder(RpcReply)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(waker, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if monitor in events:
                monitor.recv_multipart()
                with self._lock:
                    targets = list(self._pending.items())
                for call_id, target in targets:
                    target.put(ErrorReply(call_id, "disconnected", DISCONNECTED))
            if waker in events:
                waker.recv()
                while True:
                    try:
                        frame = self._outgoing.get_nowait()
                    except queue.Empty:
                        break
                    if frame is None:
                        sock.disable_monitor()
                        monitor.close(linger=0)
                        sock.close()
                        waker.close()
                        return
                    sock.send(frame)
            if sock in events:
                reply = decoder.decode(sock.recv())
                with self._lock:
                    target = self._pending.get(reply.call_id)
                if target is not None:
                    target.put(reply)

    def _send(self, call: Any, reply: bool = True) -> queue.Queue:
        replies: queue.Queue = queue.Queue()
        with self._lock:
            frame = _encode_call(self._encoder, call, self.max_frame_bytes)
            if reply:
                self._pending[call.call_id] = replies
            self._outgoing.put(frame)
            self._poke.send(b"")
        return replies

    def _wait(self, call_id: int, replies: queue.Queue, timeout: float | None) -> Any:
        try:
            reply = replies.get(timeout=timeout if timeout is not None else self.timeout)
        except queue.Empty:
            raise TimeoutError(f"no reply to call {call_id} in time") from None
        if isinstance(reply, ErrorReply):
            raise ServerError(reply.code, reply.message)
        return reply

    def _call(self, call: Any, timeout: float | None = None) -> Any:
        replies = self._send(call)
        try:
            return answer(self._wait(call.call_id, replies, timeout), self.typed)
        finally:
            with self._lock:
                self._pending.pop(call.call_id, None)

    def generate(self, prompt: str | list[str] | None = None,
                 sampling_params: dict | list[dict] | None = None,
                 input_ids: list | None = None, *, stream: bool = False,
                 rid: str | list[str] | None = None, timeout: float | None = None,
                 **kwargs: Any) -> Any:
        """Same arguments and results as `Engine.generate` (also `return_logprob`,
        `logprob_start_len`, `top_logprobs_num`, `return_text_in_logprobs`). With
        `stream=True`, returns an iterator of chunks `{"index", "text", "token_ids"}` (text
        since the previous chunk) ending with `{"final": result}`."""
        call = _generate_call(next(self._ids), prompt, input_ids, stream, rid,
                              {"sampling_params": sampling_params, **kwargs,
                               "api_key": kwargs.get("api_key") or self.api_key})
        if not stream:
            return self._call(call, timeout)
        return self._stream(call, timeout)

    def _stream(self, call: GenerateCall, timeout: float | None) -> Iterator[dict]:
        replies = self._send(call)
        complete = False
        try:
            while not complete:
                reply = self._wait(call.call_id, replies, timeout)
                complete = not isinstance(reply, ChunkReply)
                yield _stream_item(reply, self.typed)
        except ServerError:
            complete = True
            raise
        finally:
            with self._lock:
                self._pending.pop(call.call_id, None)
            if not complete:  # abandoned mid-stream: free its blocks (as its caller)
                for rid in _rids(call.rid):
                    self._send(AbortCall(next(self._ids), rid, call.api_key), reply=False)

    def beam_search(self, prompt: str | list[str] | None = None, input_ids: list | None = None,
                    *, beam_width: int = 4, max_new_tokens: int = 16, length_penalty: float = 1.0,
                    early_stopping: bool | str = False, ignore_eos: bool = False,
                    stop_token_ids: list[int] | None = None, skip_special_tokens: bool = True,
                    rid: str | list[str] | None = None, timeout: float | None = None,
                    cache_salt: str | None = None) -> Any:
        """`Engine.beam_search` over RPC: per prompt, its beams best first."""
        call = _generate_call(next(self._ids), prompt, input_ids, False, rid, beam_arguments(
            beam_width, max_new_tokens, length_penalty, early_stopping, ignore_eos,
            stop_token_ids, skip_special_tokens) | {"api_key": self.api_key,
                                                    "cache_salt": cache_salt})
        return self._call(call, timeout)

    def abort(self, rid: str, api_key: str | None = None) -> Any:
        """Abort the request `rid` (with API keys: only the caller's own requests)."""
        return self._call(AbortCall(next(self._ids), rid, api_key or self.api_key))

    def flush_cache(self) -> Any:
        return self._call(FlushCacheCall(next(self._ids), self.api_key))

    def model_info(self) -> dict:
        return self._call(ModelInfoCall(next(self._ids), self.api_key))

    def stats(self) -> dict:
        return self._call(StatsCall(next(self._ids), self.api_key))

    def health(self) -> dict:
        return self._call(HealthCall(next(self._ids), self.api_key))

    def cache_snapshot(self) -> dict:
        """The server's radix tree as page hashes, for a cache-aware router:
        `{"epoch", "seq", "page_size", "hashes", "load"}` (see CacheSnapshotCall)."""
        return self._call(CacheSnapshotCall(next(self._ids), self.api_key))

    def start_profile(self, output_dir: str | None = None) -> dict:
        """Start a torch.profiler trace of the worker's steps (written, when stopped, to the
        server's profile directory, or to `output_dir`, one name inside it); an error if
        one is already running. The operator's call."""
        return self._call(ProfileCall(next(self._ids), "start", output_dir, self.api_key))

    def stop_profile(self) -> dict:
        """Stop the trace and write it: the reply names the file (`trace`)."""
        return self._call(ProfileCall(next(self._ids), "stop", None, self.api_key))

    def workers(self, action: str = "list", url: str | None = None) -> dict:
        """A router's replicas: `list`, or `add` / `remove` the one at `url` (its RPC
        address). A server answers invalid_request."""
        return self._call(WorkersCall(next(self._ids), action, url, self.api_key))

    def pin_prefix(self, text: str | None = None, input_ids: list[int] | None = None, *,
                   ttl: float | None = None, cache_salt: str | None = None,
                   api_key: str | None = None, timeout: float | None = None) -> dict:
        """Keep a prefix (its whole pages) in the server's memory, prefilled first if it
        is not cached, until `unpin_prefix` or `ttl` seconds (see PinCall):
        `{"tokens", "expires_in", "tier", "pinned_tokens"}`. ServerError invalid_request
        past the server's `--max-pinned-tokens`."""
        return self._call(PinCall(call_id=next(self._ids), text=text, input_ids=input_ids,
                                  ttl=ttl, cache_salt=cache_salt,
                                  api_key=api_key or self.api_key), timeout)

    def unpin_prefix(self, text: str | None = None, input_ids: list[int] | None = None, *,
                     cache_salt: str | None = None, api_key: str | None = None) -> dict:
        """Drop the pin of exactly this prefix: `{"unpinned": bool, "tokens", ...}`."""
        return self._call(UnpinCall(call_id=next(self._ids), text=text, input_ids=input_ids,
                                    cache_salt=cache_salt, api_key=api_key or self.api_key))

    def unpin_all(self, api_key: str | None = None) -> dict:
        """Drop every pin the caller may see (with API keys: its tenant's):
        `{"unpinned": bool, "pins", "tokens", "pinned_tokens"}`."""
        return self._call(UnpinCall(call_id=next(self._ids), all=True,
                                    api_key=api_key or self.api_key))

    def cache_info(self, top: int = 20, api_key: str | None = None) -> dict:
        """The radix tree summarised (see CacheInfoCall and docs/rpc.md): `nodes` (the
        largest and hottest prefixes, with `text`), `totals` per tier, `pins`."""
        return self._call(CacheInfoCall(call_id=next(self._ids), top=top,
                                        api_key=api_key or self.api_key))

    def close(self) -> None:
        self._outgoing.put(None)
        with self._lock:
            self._poke.send(b"")
        self._thread.join(5)
        self._poke.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """asyncio client: one DEALER socket, a reader task routing replies by call_id."""

    typed = False
    """See `answer`: the HTTP server's client sets it, to read results as structs."""

    def __init__(self, address: str, timeout: float | None = 600.0,
                 api_key: str | None = None, *,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 stream_backlog: int | None = None) -> None:
        """`api_key` and `max_frame_bytes` as for `Client`. `stream_backlog`: chunks held
        for a stream whose reader lags; past it the stream is aborted and ends with
        ServerError `slow_reader` (None: no bound)."""
        self.address, self.timeout, self.api_key = address, timeout, api_key
        self.max_frame_bytes, self.stream_backlog = max_frame_bytes, stream_backlog
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock.connect(address)
        self._streams: dict[int, GenerateCall] = {}
        """Each stream in flight, by call_id (to abort a slow one: its rids, as its caller)."""
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Queue] = {}
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(RpcReply)
        self._reader: asyncio.Task | None = None

    async def _read(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            events = dict(await poller.poll())
            if self._monitor in events:
                await self._monitor.recv_multipart()
                for call_id, target in list(self._pending.items()):
                    target.put_nowait(ErrorReply(call_id, "disconnected", DISCONNECTED))
            if self._sock not in events:
                continue
            reply = self._decoder.decode(await self._sock.recv())
            target = self._pending.get(reply.call_id)
            if target is None:
                continue
            stream = self._streams.get(reply.call_id)
            if (stream is not None and self.stream_backlog is not None
                    and target.qsize() >= self.stream_backlog):
                self._pending.pop(reply.call_id, None)  # what else comes for it is dropped
                del self._streams[reply.call_id]
                target.put_nowait(ErrorReply(reply.call_id, "slow_reader", (
                    f"the stream was ended: its client read too slowly, and more than "
                    f"{self.stream_backlog} chunks (--http-stream-backlog) waited for it")))
                for rid in _rids(stream.rid):
                    await self._sock.send(self._encoder.encode(
                        AbortCall(next(self._ids), rid, stream.api_key)))
                continue
            target.put_nowait(reply)

    async def _send(self, call: Any) -> asyncio.Queue:
        frame = _encode_call(self._encoder, call, self.max_frame_bytes)
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read())
        replies: asyncio.Queue = asyncio.Queue()
        self._pending[call.call_id] = replies
        await self._sock.send(frame)
        return replies

    async def _wait(self, replies: asyncio.Queue, timeout: float | None) -> Any:
        try:
            reply = await asyncio.wait_for(replies.get(), timeout or self.timeout)
        except asyncio.TimeoutError:
            raise TimeoutError("no reply in time") from None
        if isinstance(reply, ErrorReply):
            raise ServerError(reply.code, reply.message)
        return reply

    async def _call(self, call: Any, timeout: float | None = None) -> Any:
        replies = await self._send(call)
        try:
            return answer(await self._wait(replies, timeout), self.typed)
        finally:
            self._pending.pop(call.call_id, None)

    async def generate(self, prompt: Any = None, sampling_params: Any = None,
                       input_ids: Any = None, *, rid: Any = None, timeout: float | None = None,
                       **kwargs: Any) -> Any:
        call = _generate_call(next(self._ids), prompt, input_ids, False, rid,
                              {"sampling_params": sampling_params, **kwargs,
                               "api_key": kwargs.get("api_key") or self.api_key})
        return await self._call(call, timeout)

    async def generate_stream(self, prompt: Any = None, sampling_params: Any = None,
                              input_ids: Any = None, *, rid: Any = None,
                              timeout: float | None = None, **kwargs: Any) -> AsyncIterator[dict]:
        call = _generate_call(next(self._ids), prompt, input_ids, True, rid,
                              {"sampling_params": sampling_params, **kwargs,
                               "api_key": kwargs.get("api_key") or self.api_key})
        self._streams[call.call_id] = call
        try:
            replies = await self._send(call)
        except BaseException:
            self._streams.pop(call.call_id, None)
            raise
        complete = False
        try:
            while not complete:
                reply = await self._wait(replies, timeout)
                complete = not isinstance(reply, ChunkReply)
                yield _stream_item(reply, self.typed)
        except ServerError:
            complete = True
            raise
        finally:
            self._pending.pop(call.call_id, None)
            self._streams.pop(call.call_id, None)
            if not complete:  # abandoned mid-stream: free its blocks (as its caller)
                for rid in _rids(call.rid):
                    await self._sock.send(self._encoder.encode(
                        AbortCall(next(self._ids), rid, call.api_key)))

    async def beam_search(self, prompt: Any = None, input_ids: Any = None, *,
                          beam_width: int = 4, max_new_tokens: int = 16,
                          length_penalty: float = 1.0, early_stopping: bool | str = False,
                          ignore_eos: bool = False, stop_token_ids: list[int] | None = None,
                          skip_special_tokens: bool = True, rid: Any = None,
                          timeout: float | None = None, cache_salt: str | None = None) -> Any:
        """`Engine.beam_search` over RPC: per prompt, its beams best first."""
        call = _generate_call(next(self._ids), prompt, input_ids, False, rid, beam_arguments(
            beam_width, max_new_tokens, length_penalty, early_stopping, ignore_eos,
            stop_token_ids, skip_special_tokens) | {"api_key": self.api_key,
                                                    "cache_salt": cache_salt})
        return await self._call(call, timeout)

    async def abort(self, rid: str, api_key: str | None = None) -> Any:
        return await self._call(AbortCall(next(self._ids), rid, api_key or self.api_key))

    async def flush_cache(self, api_key: str | None = None) -> Any:
        return await self._call(FlushCacheCall(next(self._ids), api_key or self.api_key))

    async def model_info(self) -> dict:
        return await self._call(ModelInfoCall(next(self._ids), self.api_key))

    async def stats(self, api_key: str | None = None) -> dict:
        return await self._call(StatsCall(next(self._ids), api_key or self.api_key))

    async def health(self) -> dict:
        return await self._call(HealthCall(next(self._ids), self.api_key))

    async def cache_snapshot(self) -> dict:
        """See `Client.cache_snapshot`."""
        return await self._call(CacheSnapshotCall(next(self._ids), self.api_key))

    async def start_profile(self, output_dir: str | None = None,
                            api_key: str | None = None) -> dict:
        return await self._call(ProfileCall(next(self._ids), "start", output_dir,
                                            api_key or self.api_key))

    async def stop_profile(self, api_key: str | None = None) -> dict:
        return await self._call(ProfileCall(next(self._ids), "stop", None,
                                            api_key or self.api_key))

    async def workers(self, action: str = "list", url: str | None = None,
                      api_key: str | None = None) -> dict:
        return await self._call(WorkersCall(next(self._ids), action, url,
                                            api_key or self.api_key))

    async def pin_prefix(self, text: str | None = None, input_ids: list[int] | None = None, *,
                         ttl: float | None = None, cache_salt: str | None = None,
                         api_key: str | None = None, timeout: float | None = None) -> dict:
        """See `Client.pin_prefix`."""
        return await self._call(PinCall(call_id=next(self._ids), text=text, input_ids=input_ids,
                                        ttl=ttl, cache_salt=cache_salt,
                                        api_key=api_key or self.api_key), timeout)

    async def unpin_prefix(self, text: str | None = None, input_ids: list[int] | None = None,
                           *, cache_salt: str | None = None,
                           api_key: str | None = None) -> dict:
        """See `Client.unpin_prefix`."""
        return await self._call(UnpinCall(call_id=next(self._ids), text=text,
                                          input_ids=input_ids, cache_salt=cache_salt,
                                          api_key=api_key or self.api_key))

    async def unpin_all(self, api_key: str | None = None) -> dict:
        """See `Client.unpin_all`."""
        return await self._call(UnpinCall(call_id=next(self._ids), all=True,
                                          api_key=api_key or self.api_key))

    async def cache_info(self, top: int = 20, api_key: str | None = None) -> dict:
        """See `Client.cache_info`."""
        return await self._call(CacheInfoCall(call_id=next(self._ids), top=top,
                                              api_key=api_key or self.api_key))

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()
