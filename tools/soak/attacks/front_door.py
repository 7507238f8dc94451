"""The front door before a key is known (issue 53, items 4 and 5): a large RPC call with
no key or a wrong one in its envelope, an HTTP body announced with a wrong key, and a
burst of slow connections. Each must be refused at once (`unauthorized` unread, a 401
that closes the connection), or closed by the server within its header timeout; the
soak's victims and sentinel judge what the rest of the traffic felt meanwhile."""

from __future__ import annotations

import socket
import time
from functools import cache
from urllib.parse import urlsplit

import msgspec
import zmq

from tools.soak.attacks.base import Attacker
from tools.soak.outcome import Outcome, failed, refused
from radixserve.config import ServerConfig
from radixserve.messages import MAX_INPUT_IDS, Envelope, GenerateCall

SLOW_CONNECTIONS = 64
"""Connections one slow-header burst opens (the soak's server keeps its default cap)."""


@cache
def _big_call() -> bytes:
    """~10 MiB of ids (built once): a decode would build every int."""
    return msgspec.msgpack.encode(GenerateCall(call_id=7, input_ids=[[1] * MAX_INPUT_IDS] * 10,
                                               sampling_params={"max_new_tokens": 1}))


def big_call_without_key(a: Attacker) -> list[tuple[str, Outcome]]:
    """A ~10 MiB generate call whose envelope carries no key, or a wrong one: refused
    `unauthorized` before it is decoded."""
    key = a.rng.choice([None, "sk-not-a-key"])
    sock = a.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(a.soak.rpc_address)
    try:
        sock.send_multipart([msgspec.msgpack.encode(Envelope(7, key)), _big_call()])
        if not sock.poll(int(a.timeout * 1000)):
            return [("front_door.big_call", failed("no_answer", f"no reply in {a.timeout:g} s"))]
        reply = msgspec.msgpack.decode(sock.recv())
    finally:
        sock.close(linger=0)
    if reply.get("code") == "unauthorized":
        return [("front_door.big_call", refused("unauthorized"))]
    return [("front_door.big_call", failed(str(reply.get("code")), repr(reply)[:200]))]


def body_without_key(a: Attacker) -> list[tuple[str, Outcome]]:
    """A POST announcing a 12 MB body under a wrong key, the body never sent: a 401 that
    closes the connection, not a server waiting to read the body."""
    where = urlsplit(a.soak.http_url)
    head = (f"POST /generate HTTP/1.1\r\nHost: {where.hostname}\r\nContent-Length: 12000000\r\n"
            "Authorization: Bearer sk-not-a-key\r\nContent-Type: application/json\r\n\r\n")
    answer = b""
    with socket.create_connection((where.hostname, where.port), timeout=a.timeout) as sock:
        sock.sendall(head.encode())
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except TimeoutError:
            return [("front_door.body", failed("connection_held", answer[:200].decode(
                "latin-1")))]
    if answer.startswith(b"HTTP/1.1 401"):
        return [("front_door.body", refused("401"))]
    return [("front_door.body", failed("not_refused", answer[:200].decode("latin-1")))]


def slow_connections(a: Attacker) -> list[tuple[str, Outcome]]:
    """SLOW_CONNECTIONS connections sending a header line a second, never the blank line:
    each closed by the server (408, or its cap) within the header timeout."""
    where = urlsplit(a.soak.http_url)
    limit = ServerConfig.http_header_timeout + 5.0
    socks = []
    for _ in range(SLOW_CONNECTIONS):
        s = socket.create_connection((where.hostname, where.port), timeout=5)
        s.sendall(b"GET /health HTTP/1.1\r\n")
        s.setblocking(False)
        socks.append(s)
    start = time.monotonic()
    try:
        while socks and time.monotonic() - start < limit:
            time.sleep(1.0)
            open_ = []
            for s in socks:
                try:
                    if s.recv(4096) == b"":
                        s.close()
                        continue
                except BlockingIOError:
                    pass
                except OSError:
                    s.close()
                    continue
                try:
                    s.send(b"X-Slow: 1\r\n")
                    open_.append(s)
                except OSError:
                    s.close()
            socks = open_
    finally:
        for s in socks:
            s.close()
    if socks:
        return [("front_door.slow_connections", failed(
            "connection_held", f"{len(socks)} still open after {limit:g} s"))]
    return [("front_door.slow_connections", refused("closed"))]


ATTACKS = [("front_door", big_call_without_key, 1), ("front_door", body_without_key, 1),
           ("front_door", slow_connections, 0.3)]
