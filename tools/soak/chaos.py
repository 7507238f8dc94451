"""Chaos on a raw ZeroMQ DEALER: malformed frames, which must be refused, and raw clients
that vanish mid-stream."""

from __future__ import annotations

import os
import random
import uuid
from typing import Any

import msgspec
import zmq

from tools.soak.state import Soak
from radixserve.messages import (
    ChunkReply,
    ErrorReply,
    GenerateCall,
    ResultReply,
    RpcReply,
)

# -- chaos: malformed frames and vanishing raw clients --------------------------------------
MALFORMED_CODES = {"wrong_types": {"invalid_request"}, "unknown_call": {"invalid_request"},
                   "random_bytes": {"malformed_frame", "invalid_request"}}
"""The errors a malformed call of each kind may be answered with: msgpack that fits no call
is an `invalid_request` naming the field (random bytes now and then are such msgpack, a
lone small integer say); anything else `malformed_frame`."""


def malformed_frames(rng: random.Random) -> tuple[str, list[bytes]]:
    """One malformed call (its kind, its frames)."""
    enc = msgspec.msgpack.encode
    valid = msgspec.msgpack.Encoder().encode(GenerateCall(
        call_id=rng.randrange(1, 1 << 30), input_ids=[1, 2, 3], sampling_params={}))
    choice = rng.randrange(7)
    if choice == 0:
        return "garbage", [b"\xc1" + os.urandom(rng.randint(0, 256))]  # 0xc1: never msgpack
    if choice == 1:
        return "random_bytes", [os.urandom(rng.randint(1, 512))]
    if choice == 2:
        return "wrong_types", [enc({"type": "generate", "call_id": 77, "input_ids": "abc",
                                    "sampling_params": 5})]
    if choice == 3:
        return "multipart", [valid, b"extra", b"more"]
    if choice == 4:
        return "truncated", [valid[:rng.randint(1, len(valid) - 1)]]
    if choice == 5:
        return "empty", [b""]
    return "unknown_call", [enc({"type": "self_destruct", "call_id": 78})]


def chaos_thread(soak: Soak, seed: int) -> None:
    rng = random.Random(seed)
    ctx = zmq.Context()
    decoder = msgspec.msgpack.Decoder(RpcReply)
    try:
        while soak.running():
            soak.begin()
            if rng.random() < 0.75:
                kind, frames = malformed_frames(rng)
                raw_malformed(soak, ctx, decoder, kind, frames)
            else:
                raw_vanish(soak, ctx, decoder, rng)
            soak.stop.wait(rng.uniform(0.2, 2.0))
    finally:
        ctx.destroy(linger=0)


def _raw_socket(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def raw_malformed(soak: Soak, ctx: zmq.Context, decoder: Any, chaos: str,
                  frames: list[bytes]) -> None:
    kind = f"chaos.{chaos}"
    sock = _raw_socket(ctx, soak.rpc_address)
    try:
        sock.send_multipart(frames)
        if not sock.poll(30_000):
            return soak.fail(kind, "no_answer", "no reply to a malformed frame in 30 s")
        reply = decoder.decode(sock.recv())
        if isinstance(reply, ErrorReply) and reply.code in MALFORMED_CODES.get(
                chaos, {"malformed_frame"}):
            return soak.record(kind, "refused")
        soak.fail(kind, "malformed_accepted", repr(reply)[:200])
    except msgspec.DecodeError as e:
        soak.fail(kind, "undecodable_reply", repr(e))
    finally:
        sock.close(linger=0)


def raw_vanish(soak: Soak, ctx: zmq.Context, decoder: Any, rng: random.Random) -> None:
    """A raw client that starts a stream, reads its first chunk and disappears without an
    abort: the front door must notice when its next reply cannot be delivered."""
    kind = "chaos.vanish"
    case = soak.case(rng)
    sock = _raw_socket(ctx, soak.rpc_address)
    try:
        sock.send(msgspec.msgpack.Encoder().encode(GenerateCall(
            call_id=1, input_ids=case.ids, stream=True, rid=f"soak-vanish-{uuid.uuid4().hex}",
            api_key=soak.key(0),
            sampling_params={**case.params, "max_new_tokens": 64})))
        if not sock.poll(int(soak.args.call_timeout * 1000)):
            return soak.fail(kind, "no_answer", "no first chunk")
        reply = decoder.decode(sock.recv())
        if isinstance(reply, ErrorReply):
            return soak.fail(kind, reply.code, reply.message)
        if not isinstance(reply, (ChunkReply, ResultReply)):
            return soak.fail(kind, "bad_answer", repr(reply)[:200])
        soak.record(kind, "disconnected")
    finally:
        sock.close(linger=0)
