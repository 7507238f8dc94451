"""`Client`: the RPC operations over one socket that a background I/O thread owns."""

from __future__ import annotations

import queue
import threading
import uuid
from typing import Any, Iterator

import msgspec
import zmq

from radixserve.client.frames import DEFAULT_MAX_FRAME_BYTES, call_frames
from radixserve.client.link import CONNECT_TIMEOUT, Link
from radixserve.client.operations import Operations
from radixserve.client.replies import DISCONNECTED, ends_stream, result, stream_item
from radixserve.messages import AbortCall, ErrorReply, GenerateCall, RpcCall, RpcReply, decode
from radixserve.results.errors import ErrorCode


class ThreadTransport:
    """Thread-safe: a background thread owns the zmq DEALER socket and routes each reply
    by `call_id` to its caller's own queue, so many calls are in flight at once. If the
    connection drops, every waiting call gets a `disconnected` error."""

    def __init__(self, address: str, timeout: float | None, max_frame_bytes: int,
                 connect_timeout: float = CONNECT_TIMEOUT) -> None:
        """`timeout`: how long a call waits for each reply unless told (None: forever);
        `connect_timeout`: how long it waits with nothing connected (`Link`)."""
        self.address, self.timeout, self.max_frame_bytes = address, timeout, max_frame_bytes
        self._link = Link(address, connect_timeout)
        self._ctx = zmq.Context()
        self._pending: dict[int, queue.Queue[RpcReply]] = {}
        self._lock = threading.Lock()
        self._outgoing: queue.Queue[list[bytes] | None] = queue.Queue()
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
        monitor = sock.get_monitor_socket(Link.EVENTS)
        sock.connect(self.address)
        decoder = msgspec.msgpack.Decoder(RpcReply)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(waker, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        link = self._link
        while True:
            events = dict(poller.poll(link.poll_ms(bool(self._pending))))
            why = DISCONNECTED if monitor in events and link.on_event(
                monitor.recv_multipart()) else link.unreachable()
            if why is not None:
                with self._lock:
                    targets = list(self._pending.items())
                for call_id, waiting in targets:
                    waiting.put(ErrorReply(call_id, ErrorCode.DISCONNECTED, why))
            if waker in events:
                waker.recv()
                while True:
                    try:
                        frames = self._outgoing.get_nowait()
                    except queue.Empty:
                        break
                    if frames is None:
                        sock.disable_monitor()
                        monitor.close(linger=0)
                        sock.close()
                        waker.close()
                        return
                    sock.send_multipart(frames)
            if sock in events:
                reply = decode(decoder, sock.recv())
                with self._lock:
                    target = self._pending.get(reply.call_id)
                if target is not None:
                    target.put(reply)

    def _send(self, call: RpcCall, reply: bool = True) -> queue.Queue[RpcReply]:
        replies: queue.Queue[RpcReply] = queue.Queue()
        with self._lock:
            frames = call_frames(self._encoder, call, self.max_frame_bytes)
            if reply:
                self._pending[call.call_id] = replies
            self._outgoing.put(frames)
            self._poke.send(b"")
        return replies

    def _wait(self, call_id: int, replies: queue.Queue[RpcReply],
              timeout: float | None) -> RpcReply:
        try:
            return replies.get(timeout=timeout if timeout is not None else self.timeout)
        except queue.Empty:
            raise TimeoutError(f"no reply to call {call_id} in time") from None

    def request(self, call: RpcCall, timeout: float | None) -> RpcReply:
        """Send `call` and wait for its one reply."""
        replies = self._send(call)
        try:
            return self._wait(call.call_id, replies, timeout)
        finally:
            with self._lock:
                self._pending.pop(call.call_id, None)

    def stream(self, call: GenerateCall, aborts: list[AbortCall],
               timeout: float | None) -> Iterator[dict[str, Any]]:
        """Send a streamed call and yield its replies as `stream_item`s (each within
        `timeout`); if the caller leaves before the last, send `aborts`."""
        replies = self._send(call)
        complete = False
        try:
            while not complete:
                reply = self._wait(call.call_id, replies, timeout)
                complete = ends_stream(reply)
                yield stream_item(reply)
        finally:
            with self._lock:
                self._pending.pop(call.call_id, None)
            if not complete:  # abandoned mid-stream: free its blocks
                for abort in aborts:
                    self._send(abort, reply=False)

    def close(self) -> None:
        self._outgoing.put(None)
        with self._lock:
            self._poke.send(b"")
        self._thread.join(5)
        self._poke.close(linger=0)
        self._ctx.term()


class Client(Operations[Any]):
    """The RPC client (see `radixserve.api.Api` for its operations); thread-safe."""

    def __init__(self, address: str, timeout: float | None = 600.0,
                 api_key: str | None = None, *,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 connect_timeout: float = CONNECT_TIMEOUT) -> None:
        """`timeout`: seconds a call waits for each reply unless told (None: forever).
        `api_key`: the caller's key when the server has keys (it names the tenant).
        `max_frame_bytes`: the server's limit; a larger call raises ServerError
        `frame_too_large` here rather than lose the connection. If the connection drops
        anyway, calls in flight fail with `disconnected`, and so do calls that wait
        `connect_timeout` seconds with nothing connected (no server at `address`)."""
        super().__init__(api_key)
        self._transport = ThreadTransport(address, timeout, max_frame_bytes, connect_timeout)

    @property
    def address(self) -> str:
        return self._transport.address

    def _call(self, call: RpcCall, timeout: float | None, field: str | None = None) -> Any:
        answer = result(self._transport.request(call, timeout))
        return answer if field is None else answer[field]

    def _stream(self, call: GenerateCall, timeout: float | None) -> Iterator[dict[str, Any]]:
        return self._transport.stream(call, self._stream_aborts(call), timeout)

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
