"""The cache-events socket, open to the operator only: the front door's PUB socket (its
CacheEvents, for a cache-aware router) and a subscriber's side of it.

The page hashes it carries name every tenant's cached prefixes, so subscribing takes an
operator key (tenants.Tenants.is_operator), checked by ZeroMQ's own authentication (ZAP,
pyzmq's ThreadAuthenticator) with the PLAIN mechanism: the subscriber's password is the
key, its user name the key's fingerprint (one entry per operator key). A subscriber
without a valid key completes no handshake and receives nothing. PLAIN carries the key in
the clear, as every RPC call carries its own: keep the port on a private network. A
server without any key (single-user) publishes without authentication (NULL).
"""

from __future__ import annotations

import hashlib
import logging

import zmq
from zmq.auth.thread import ThreadAuthenticator

from radixserve.tenants import Tenants
from radixserve.transport.sockets import bind_tcp

CACHE_EVENTS_SNDHWM = 10_000
"""CacheEvents queued per subscriber before the PUB socket drops them (it never blocks the
front door). A subscriber that falls this far behind sees a `seq` gap and resyncs from a
snapshot; at one event per step, this is minutes of steps."""

_auth_log = logging.getLogger("radixserve.cache_events.auth")
_auth_log.setLevel(logging.INFO)  # pyzmq logs an accepted password at DEBUG


def operator_user(api_key: str) -> str:
    """The PLAIN user name of an operator key: its fingerprint, never the key itself."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:32]


class EventsPublisher:
    """The PUB socket (`sock`) on `host:port` (0: a free port), in a context of its own so
    that its authenticator sees no other socket. `address` is what `model_info` reports.
    A send on it never blocks: past SNDHWM a slow subscriber's events are dropped. As
    `zmq.XPUB` (`kind`), its owner also reads who subscribes (`Subscriptions`)."""

    def __init__(self, tenants: Tenants, host: str, port: int, kind: int = zmq.PUB) -> None:
        self.ctx = zmq.Context()
        self.auth: ThreadAuthenticator | None = None
        self.sock = self.ctx.socket(kind)
        self.sock.setsockopt(zmq.SNDHWM, CACHE_EVENTS_SNDHWM)
        self.sock.setsockopt(zmq.LINGER, 0)
        if not tenants.everyone_operates:
            self.auth = ThreadAuthenticator(self.ctx, log=_auth_log)
            self.auth.start()
            # No operator key (several tenants, no --admin-api-key): nobody may subscribe.
            self.auth.configure_plain(domain="*", passwords={
                operator_user(k): k for k in tenants.operator_keys})
            self.sock.plain_server = True
        self.address = bind_tcp(self.sock, host, port)

    def close(self) -> None:
        if self.auth is not None:
            self.auth.stop()
        self.ctx.destroy(linger=0)


class Subscriptions:
    """Whether anyone subscribes to an XPUB socket's events (`any`), from the frames the
    socket passes on: ZeroMQ passes a topic's first subscription and its last
    unsubscription only (a subscriber that leaves unsubscribes), so the topics held are
    exactly those some subscriber wants. Bounded as the socket's own subscription tree."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.topics: set[bytes] = set()
        self.any = False

    def take(self) -> None:
        """Read the (un)subscriptions waiting (the socket is readable: call it then)."""
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if frame[:1] == b"\x01":
                self.topics.add(frame[1:])
            elif frame[:1] == b"\x00":
                self.topics.discard(frame[1:])
        self.any = bool(self.topics)


def subscribe(ctx: zmq.Context, address: str, api_key: str | None) -> zmq.Socket:
    """A SUB socket on a replica's events `address`, authenticated with the operator key
    `api_key` (None: for a replica without keys)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    if api_key is not None:
        sub.plain_username = operator_user(api_key).encode()
        sub.plain_password = api_key.encode()
    sub.connect(address)
    return sub
