"""Issue 53, item 4 (finding 5): nothing is decoded for a caller before its key is known.
Before, `replies.receive` decoded every typed RPC frame (up to ~15 MiB) before the front
door read its key, so two senders without a key took a 0.2-0.4 s decode each per frame
from the loop every tenant shares. Now a call over `MAX_BARE_CALL_BYTES` travels as two
frames, an `Envelope` (its id and key) and the call, and such a call whose envelope
carries no known key (or that came alone, without one) is answered `unauthorized`
unread. Over HTTP the key is checked before a byte of the body is read, and a refused
request's connection closes, so its body is not read either.

On the two-tenant harness: senders without a valid key (raw single frames, envelopes
with a wrong key, the project's own client with a wrong key; several payload shapes and
sizes) flood the RPC port, or send large bodies over HTTP, while alice's plain requests
run: each is refused at once, and alice's latency stays within max(3x, 2 s)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Callable
from urllib.parse import urlsplit

import msgspec
import pytest
import zmq

from radixserve.client import ServerError
from radixserve.messages import MAX_INPUT_IDS, Envelope, GenerateCall
from tests.server.attack_harness import (ALICE_KEY, AttackServer, assert_unaffected,
                                         attack_server)

ATTACK_S = 5.0
"""How long each flood lasts: alice's samples run inside it."""
REFUSED_WITHIN_S = 2.0
LATENCY_FLOOR_S = 2 / 3
"""With a ratio of 3: alice within max(3x her unloaded latency, 2 s)."""
SENDERS = 3


def run_senders(sender, timeout_s: float) -> None:
    """`sender(i)` for each of the `SENDERS` attackers, on threads of their own; returns
    when all have ended (or after `timeout_s` each)."""
    threads = [threading.Thread(target=sender, args=(i,)) for i in range(SENDERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with attack_server(tmp_path_factory) as s:
        yield s


def ids_call(lists: int, call_id: int = 1, **fields: Any) -> GenerateCall:
    """A generate call of `lists` prompts of MAX_INPUT_IDS ids each (1 MiB of msgpack a list:
    the typed decode builds every int)."""
    return GenerateCall(call_id=call_id, input_ids=[[1] * MAX_INPUT_IDS] * lists,
                        sampling_params={"max_new_tokens": 1}, **fields)


PAYLOADS: dict[str, Callable[[], list[bytes]]] = {
    # An older client's single frame, no key, 14 MiB of ids (the last list one too long,
    # so a decode would run to the end before refusing it).
    "single-frame-ids": lambda: [msgspec.msgpack.encode({
        "type": "generate", "call_id": 3, "input_ids": [[1] * MAX_INPUT_IDS] * 13
        + [[1] * (MAX_INPUT_IDS + 1)]})],
    # An envelope with a wrong key before 12 MiB of short texts (each a str to build).
    "envelope-wrong-key-texts": lambda: [
        msgspec.msgpack.encode(Envelope(4, "sk-wrong")),
        msgspec.msgpack.encode(GenerateCall(call_id=4, text=["abc"] * 65536,
                                            sampling_params=[{"stop": ["zz"] * 40}] * 65536,
                                            api_key="sk-wrong"))],
    # An envelope with no key at all, and a valid key inside the 9 MiB call: the key
    # checked is the envelope's.
    "envelope-no-key-inner-key": lambda: [
        msgspec.msgpack.encode(Envelope(5)),
        msgspec.msgpack.encode(ids_call(9, call_id=5, api_key=ALICE_KEY))],
}


def flood_rpc(s: AttackServer, frames: list[bytes], period_s: float) -> int:
    """SENDERS raw DEALER sockets send `frames` every `period_s` for ATTACK_S, each reading
    its answer: every one must be `unauthorized`, within REFUSED_WITHIN_S. Returns how many
    were sent."""
    decoder = msgspec.msgpack.Decoder()
    sent = [0] * SENDERS
    failures: list[str] = []

    def sender(i: int) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(s.rpc_address)
        try:
            end = time.monotonic() + ATTACK_S
            while time.monotonic() < end and not failures:
                start = time.monotonic()
                sock.send_multipart(frames, copy=False)
                if not sock.poll(int(REFUSED_WITHIN_S * 1000 * 10)):
                    failures.append("no answer")
                    return
                reply = decoder.decode(sock.recv())
                took = time.monotonic() - start
                if reply.get("code") != "unauthorized" or took > REFUSED_WITHIN_S:
                    failures.append(f"{reply.get('code')} after {took:.2f} s: {reply}"[:300])
                sent[i] += 1
                time.sleep(max(0.0, period_s - took))
        finally:
            sock.close(0)
            ctx.term()

    run_senders(sender, ATTACK_S + 120)
    assert not failures, failures[0]
    return sum(sent)


@pytest.mark.parametrize("payload,period_s", [("single-frame-ids", 0.2),
                                              ("envelope-wrong-key-texts", 0.3),
                                              ("envelope-no-key-inner-key", 0.15)])
def test_large_calls_without_a_known_key_are_refused_unread(server, payload, period_s):
    frames = PAYLOADS[payload]()
    assert len(frames[-1]) > 8 << 20

    def attack(s: AttackServer) -> None:
        assert flood_rpc(s, frames, period_s) >= SENDERS

    report = assert_unaffected(server, attack, max_latency_ratio=3, max_rss_growth_mib=300,
                               latency_floor_s=LATENCY_FLOOR_S)
    print(report)


def test_the_projects_client_with_a_wrong_key_is_refused_before_its_call_is_decoded(server):
    call = ids_call(6)

    def attack(s: AttackServer) -> None:
        end = time.monotonic() + ATTACK_S
        with s.client("sk-not-a-key") as wrong, s.client(None) as none:
            while time.monotonic() < end:
                for c in (wrong, none):
                    start = time.monotonic()
                    with pytest.raises(ServerError) as e:
                        c.generate(input_ids=call.input_ids, sampling_params={"max_new_tokens": 1})
                    assert e.value.code == "unauthorized", e.value
                    assert time.monotonic() - start < REFUSED_WITHIN_S + 1

    report = assert_unaffected(server, attack, max_latency_ratio=3, max_rss_growth_mib=400,
                               latency_floor_s=LATENCY_FLOOR_S)
    print(report)


def test_small_calls_and_health_still_work_without_an_envelope_key(server):
    """A health call needs no key, and an older client's small single frame is still read
    (its own key checked): only large calls need the envelope's key."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.rpc_address)
    decoder = msgspec.msgpack.Decoder()
    try:
        for frames in ([msgspec.msgpack.encode(Envelope(1)),
                        msgspec.msgpack.encode({"type": "health", "call_id": 1})],
                       [msgspec.msgpack.encode({"type": "health", "call_id": 1})]):
            sock.send_multipart(frames)
            assert sock.poll(30_000)
            assert decoder.decode(sock.recv())["result"]["status"] == "ok"
        sock.send(msgspec.msgpack.encode({"type": "model_info", "call_id": 2,
                                          "api_key": ALICE_KEY}))
        assert sock.poll(30_000)
        assert decoder.decode(sock.recv())["type"] == "result"
        sock.send_multipart([msgspec.msgpack.encode(Envelope(3, "sk-wrong")),
                             msgspec.msgpack.encode({"type": "model_info", "call_id": 3,
                                                     "api_key": ALICE_KEY})])
        assert sock.poll(30_000)
        assert decoder.decode(sock.recv())["code"] == "unauthorized"  # the envelope's key
        sock.send_multipart([msgspec.msgpack.encode(Envelope(9, ALICE_KEY)),
                             msgspec.msgpack.encode({"type": "model_info", "call_id": 8})])
        assert sock.poll(30_000)
        reply = decoder.decode(sock.recv())
        assert reply["code"] == "invalid_request" and reply["call_id"] == 9, reply
    finally:
        sock.close(0)
        ctx.term()


# -- HTTP: the key before the body -------------------------------------------------------------
def refused_before_the_body(url: str, headers: dict[str, str], body_bytes: int,
                            chunked: bool = False) -> tuple[float, bytes]:
    """Send a POST's head announcing `body_bytes` but no body; return how long the answer
    took and the answer, read until the server closed the connection."""
    where = urlsplit(url)
    head = ["POST /generate HTTP/1.1", f"Host: {where.hostname}",
            "Content-Type: application/json",
            "Transfer-Encoding: chunked" if chunked else f"Content-Length: {body_bytes}",
            *(f"{k}: {v}" for k, v in headers.items())]
    start = time.monotonic()
    with socket.create_connection((where.hostname, where.port), timeout=10) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        if chunked:
            sock.sendall(b"10\r\n" + b"x" * 16 + b"\r\n")
        answer = b""
        try:
            while chunk := sock.recv(65536):  # the server closes it: no body is waited for
                answer += chunk
        except TimeoutError:  # it kept the connection, waiting for the body
            pass
    return time.monotonic() - start, answer


@pytest.mark.parametrize("headers,body_bytes,chunked", [
    ({}, 15_000_000, False),
    ({"Authorization": "Bearer sk-wrong"}, 64 << 20, False),  # over max_request_bytes too
    ({"Authorization": "Basic abc"}, 0, True),
])
def test_an_http_body_is_not_read_before_its_key(server, headers, body_bytes, chunked):
    took, answer = refused_before_the_body(server.http_url, headers, body_bytes, chunked)
    head = answer.split(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"http/1.1 401"), answer[:300]
    assert b"connection: close" in head, answer[:300]
    assert took < REFUSED_WITHIN_S * 5, took


def test_unauthenticated_http_bodies_flood_and_alice_is_unaffected(server):
    def attack(s: AttackServer) -> None:
        end = time.monotonic() + ATTACK_S
        failures: list[Any] = []

        def one(i: int) -> None:
            while time.monotonic() < end:
                took, answer = refused_before_the_body(
                    s.http_url, {"Authorization": f"Bearer sk-wrong-{i}"}, 12_000_000 + i)
                if not answer.startswith(b"HTTP/1.1 401") or took > REFUSED_WITHIN_S * 5:
                    failures.append((took, answer[:200]))
                    return

        run_senders(one, ATTACK_S + 60)
        assert not failures, failures[0]

    assert_unaffected(server, attack, max_latency_ratio=3, max_rss_growth_mib=300,
                      latency_floor_s=LATENCY_FLOOR_S)
