"""Replies to RPC clients over a ROUTER socket, with a bounded backlog per slow reader.

Shared by the front door and the router. A client that reads slowly (ZeroMQ's queue to it
is full) gets its replies later, in order, from a backlog; one that is gone is reported
(`on_gone`) so that its calls can be aborted and their KV blocks freed. A backlog past
`limit` ends the client's streams (what fills it): `on_slow` aborts them and names their
call ids with the error each ends with, which the client reads after the replies already
queued; its other calls go on. Past twice the limit it is not streams but ever more calls
it never reads, and memory must stay bounded: the client is taken for gone.
"""

from __future__ import annotations

import errno
import logging
import secrets
from collections import deque
from typing import Annotated, Any, Callable, TypeVar

import msgspec
import zmq

from radixserve.messages import (MAX_BARE_CALL_BYTES, MAX_ENVELOPE_BYTES, Envelope, ErrorReply,
                                 decode, error_text)
from radixserve.results.errors import ErrorCode

log = logging.getLogger(__name__)
P = TypeVar("P")
"""Who a call came from (a routing id; the front door's in-process callers have sinks)."""


class ClientReplies:
    def __init__(self, sock: zmq.Socket, limit: int, on_gone: Callable[[bytes], None],
                 on_slow: Callable[[bytes], dict[int, Any]]) -> None:
        self.sock, self.limit = sock, limit
        self.on_gone, self.on_slow = on_gone, on_slow
        self.encoder = msgspec.msgpack.Encoder()
        self.backlog: dict[bytes, deque[tuple[int, bytes]]] = {}
        """Per slow client, replies (call_id, frame) that ZeroMQ would not take yet."""

    def send(self, peer: bytes, reply: Any) -> bool:
        """Send `reply` (it has a `call_id`) to `peer`; False if the peer is gone (its
        calls were handed to `on_gone`)."""
        frame = self.encoder.encode(reply)
        queued = self.backlog.get(peer)
        if queued is None:
            try:
                self.sock.send_multipart([peer, frame], zmq.NOBLOCK)
                return True
            except zmq.ZMQError as e:
                if e.errno != errno.EAGAIN:
                    self.gone(peer)
                    return False
            queued = self.backlog[peer] = deque()
        queued.append((reply.call_id, frame))
        if len(queued) > self.limit:
            self._slow(peer, queued)
            if len(queued) > 2 * self.limit:
                log.warning("dropped a client that does not read: %d replies waiting",
                            len(queued))
                self.gone(peer)
        return True

    def flush(self) -> None:
        """Send what slow clients can take now (call it every loop while a `backlog` waits)."""
        for peer in list(self.backlog):
            queued = self.backlog[peer]
            try:
                while queued:
                    self.sock.send_multipart([peer, queued[0][1]], zmq.NOBLOCK)
                    queued.popleft()
            except zmq.ZMQError as e:
                if e.errno != errno.EAGAIN:
                    self.gone(peer)
                continue
            del self.backlog[peer]

    def receive(self, frames: list, decoder: msgspec.msgpack.Decoder,
                on_call: Callable[[bytes, Any], None],
                knows: Callable[[str | None], bool] | None = None) -> None:
        """One client message from the ROUTER socket: [peer, call] for a call of at most
        MAX_BARE_CALL_BYTES (its key inside it), else [peer, envelope, call]. The envelope
        (`Envelope`: the call's id and key) is read first, and a larger call frame decoded
        only for a key that `knows` accepts (None: every key, a server without keys);
        otherwise it is answered `unauthorized` unread, so an unknown caller's large call
        costs its bytes read, never a decode. The call, carrying the envelope's key if it
        came with one, goes to `on_call(peer, call)` (`dispatch`), which checks the key, or
        is answered with why it is no call."""
        peer = bytes(frames[0])
        if len(frames) not in (2, 3):
            self.send(peer, ErrorReply(-1, ErrorCode.MALFORMED_FRAME, (
                f"expected a call as one frame, or two (its envelope and the call), got "
                f"{len(frames) - 1}")))
            return
        envelope = read_envelope(frames[1]) if len(frames) == 3 else None
        if isinstance(envelope, ErrorReply):
            self.send(peer, envelope)
            return
        body = frames[-1]
        if len(body) > MAX_BARE_CALL_BYTES and knows is not None and not knows(
                envelope.api_key if envelope is not None else None):
            self.send(peer, ErrorReply(-1 if envelope is None else envelope.call_id,
                                       ErrorCode.UNAUTHORIZED, (
                "invalid or missing api_key: a call of more than "
                f"{MAX_BARE_CALL_BYTES} bytes is decoded only for a known key, sent in "
                "the envelope frame before it (docs/rpc.md)")))
            return
        call = decode_call(decoder, body.buffer)  # at most max_frame_bytes: see libzmq
        if isinstance(call, ErrorReply):
            self.send(peer, call)
        elif envelope is not None and call.call_id != envelope.call_id:
            self.send(peer, ErrorReply(envelope.call_id, ErrorCode.INVALID_REQUEST,
                                       f"the envelope names call_id {envelope.call_id}, the "
                                       f"call {call.call_id}"))
        else:
            if envelope is not None:  # the key checked is the one the call carries
                call.api_key = envelope.api_key
            dispatch(peer, call, on_call, self.send)

    def gone(self, peer: bytes) -> None:
        self.backlog.pop(peer, None)
        self.on_gone(peer)

    def _slow(self, peer: bytes, queued: deque[tuple[int, bytes]]) -> None:
        errors = self.on_slow(peer)
        kept = [(cid, frame) for cid, frame in queued if cid not in errors]
        queued.clear()
        queued.extend(kept)
        queued.extend((cid, self.encoder.encode(error)) for cid, error in errors.items())
        if errors:
            log.warning("ended %d stream(s) of a client that reads too slowly", len(errors))


def read_envelope(frame: Any) -> Envelope | ErrorReply:
    """A call's envelope (at most MAX_ENVELOPE_BYTES, else refused unread), or the
    ErrorReply that answers it."""
    if len(frame) > MAX_ENVELOPE_BYTES:
        return ErrorReply(-1, ErrorCode.MALFORMED_FRAME, f"the envelope frame is larger than "
                          f"{MAX_ENVELOPE_BYTES} bytes")
    try:
        return decode(_ENVELOPE, frame.buffer)
    except msgspec.DecodeError as e:
        return ErrorReply(-1, ErrorCode.MALFORMED_FRAME, f"undecodable envelope: {e} (a call "
                          "is two frames: [call_id, api_key], then the call)")


def decode_call(decoder: msgspec.msgpack.Decoder, payload: Any) -> Any:
    """A call's frame decoded (typed, and depth-bounded by `messages.decode`), or the
    ErrorReply that answers it: bytes that are not msgpack (or nest too deeply) are a
    `malformed_frame`; msgpack that does not fit a call is an `invalid_request`, naming the
    field."""
    try:
        return decode(decoder, payload)
    except msgspec.ValidationError as e:  # a DecodeError subclass: caught first
        return ErrorReply(guess_call_id(payload), ErrorCode.INVALID_REQUEST,
                          f"invalid call: {error_text(e)}")
    except msgspec.DecodeError as e:
        return ErrorReply(guess_call_id(payload), ErrorCode.MALFORMED_FRAME,
                          f"undecodable call: {e}")


def dispatch(peer: P, call: Any, on_call: Callable[[P, Any], None],
             send: Callable[[P, Any], Any]) -> None:
    """`on_call(peer, call)`; a bug in it is answered `internal` and the server goes on."""
    try:
        on_call(peer, call)
    except Exception:
        send(peer, ErrorReply(call.call_id, ErrorCode.INTERNAL,
                              internal_error(f"{type(call).__name__} failed")))


class _Named(msgspec.Struct):
    """Only a call's id: the decoder skips every other field without building it."""

    call_id: Annotated[int, msgspec.Meta(ge=-2**63, le=2**63 - 1)] = -1


_NAMED = msgspec.msgpack.Decoder(_Named)
_ENVELOPE = msgspec.msgpack.Decoder(Envelope)



def internal_error(what: str) -> str:
    """Log the exception being handled (with its traceback) under a fresh reference and
    return what the caller is told: the reference, never the exception, whose text can
    name paths, settings or another caller's data."""
    reference = secrets.token_hex(6)
    log.exception("internal error %s: %s", reference, what)
    return f"internal error (reference {reference}: the server's log has the details)"


def guess_call_id(payload: Any) -> int:
    """The call_id of an otherwise invalid call, so the client can match the error."""
    try:
        return decode(_NAMED, payload).call_id
    except msgspec.DecodeError:
        return -1
