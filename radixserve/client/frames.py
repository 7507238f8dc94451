"""A call as the frames a transport sends, within the server's frame bound: the call alone
when small, else its envelope (the call's id and key, which the server checks before it
decodes the call) and the call."""

from __future__ import annotations

import msgspec

from radixserve.client.replies import ServerError
from radixserve.messages import MAX_BARE_CALL_BYTES, Envelope, RpcCall

DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024
"""The server's `max_frame_bytes` unless told otherwise (`ServerConfig.max_frame_bytes`)."""


def encode_call(encoder: msgspec.msgpack.Encoder, call: RpcCall, limit: int) -> bytes:
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


def call_frames(encoder: msgspec.msgpack.Encoder, call: RpcCall, limit: int) -> list[bytes]:
    """The frames of one call on the wire (`bare_or_enveloped`), the call checked by
    `encode_call`."""
    return bare_or_enveloped(encoder, call, encode_call(encoder, call, limit))


def bare_or_enveloped(encoder: msgspec.msgpack.Encoder, call: RpcCall,
                      frame: bytes) -> list[bytes]:
    """`call`'s `frame` alone when it is at most MAX_BARE_CALL_BYTES, else after its
    `Envelope` (its id and key), which the server reads before it decodes a large call."""
    if len(frame) <= MAX_BARE_CALL_BYTES:
        return [frame]
    return [encoder.encode(Envelope(call.call_id, call.api_key)), frame]
