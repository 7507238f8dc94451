"""The HTTP server's connections, bounded in number and in time (issue 53, item 5).

uvicorn's h11 protocol has no cap on open connections and no timeout on a request's
headers: ~20,000 connections each sending a header line every few seconds held the
front door's every descriptor (EMFILE on each accept, RPC and internal sockets starved).
`guarded_protocol` wraps it:

- **A cap** (`Connections.limit`, `--http-max-connections`, never more than the process's
  descriptor limit less `--http-fd-reserve`, which HTTP never takes, so RPC clients and
  the internal sockets always find a descriptor). A connection past the cap closes the
  connection that has *waited* (for its request's headers, or idle between requests)
  longest, once that is a second or more; else, of those waiting or *uploading* a body,
  the one that joined its line first. First in, first out is what lets a caller who
  sends its request at once in: whatever the flood (silent or slow bodies), the
  connections it opened before the caller's go first, so the caller has the time the
  flood needs to open a cap's worth of new ones (a connection whose headers were just
  read, its body a packet behind, is no longer the first to go). When every connection
  is busy (a request read and being answered), the new one is answered 503 and closed.
- **A header timeout** (`--http-header-timeout`): a request's line and headers must
  arrive within it, counted from the connection (or from the first byte of a later
  request on it); past it, 408 and the connection closes. A body timeout
  (`--http-body-timeout`) bounds the rest of the request the same way, and the idle
  timeout between requests is uvicorn's keep-alive timeout (`--http-idle-timeout`).

So a flood of slow connections costs another caller at most the header timeout, and
usually nothing: its own connection evicts one of theirs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from collections import OrderedDict
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)
ACCEPT_BATCH = 16
"""Connections asyncio accepts in one go (uvicorn's `backlog`) before the cap sees them:
part of the descriptor reserve."""
GRACE_S = 1.0
"""A connection that has waited this long (or half the header timeout) for its request goes
for room before any connection uploading a body, however old: it has sent nothing since."""


def _answer(status: str, code: str, kind: str, message: str) -> bytes:
    """A raw HTTP answer in the API's error shape, sent before or instead of a request
    (h11 has nothing to answer yet): the connection closes after it."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": code}}).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


TIMEOUT_ANSWER = _answer("408 Request Timeout", "request_timeout", "invalid_request_error",
                         "the request's line and headers did not arrive within "
                         "http_header_timeout (--http-header-timeout)")
BUSY_ANSWER = _answer("503 Service Unavailable", "overloaded", "server_error",
                      "every connection the server keeps (http_max_connections, "
                      "--http-max-connections) is busy answering: retry later")


def connection_limit(wanted: int | None, reserve: int) -> int:
    """The cap on open HTTP connections: `wanted` (None: as many as fit), never more than
    the descriptor limit (RLIMIT_NOFILE's soft limit) less `reserve`. ValueError when no
    connection fits."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    fits = soft - reserve if soft != resource.RLIM_INFINITY else 1 << 20
    if fits < 1:
        raise ValueError(f"the descriptor limit ({soft}, `ulimit -n`) leaves no HTTP "
                         f"connection beyond http_fd_reserve={reserve} (--http-fd-reserve): "
                         "raise the limit or lower the reserve")
    if wanted is not None and wanted > fits:
        log.warning("http_max_connections=%d is more than the descriptor limit (%d) less "
                    "http_fd_reserve=%d allows: %d", wanted, soft, reserve, fits)
    return fits if wanted is None else min(wanted, fits)


class Connections:
    """The open connections, and in two lines, oldest first, those a new connection past
    `limit` may close: `waiting` (for a request's headers, or idle between requests) and
    `uploading` (a request's body still coming in), each with when it joined its line."""

    def __init__(self, limit: int, header_timeout: float, body_timeout: float) -> None:
        self.limit, self.header_timeout, self.body_timeout = limit, header_timeout, body_timeout
        self.grace = min(GRACE_S, header_timeout / 2)
        self.open: set[Any] = set()
        self.waiting: OrderedDict[Any, float] = OrderedDict()
        self.uploading: OrderedDict[Any, float] = OrderedDict()
        self.evicted = self.refused = self.timed_out = 0

    def admit(self, conn: Any) -> bool:
        """Count `conn` in, closing a connection to make room if needed (see the module's
        doc). False (the caller answers 503 and closes it) when all are busy."""
        now = time.monotonic()
        if len(self.open) >= self.limit:
            # The longest waiting once it has waited `grace`, else the first to join a line.
            victim = next(iter(self.waiting), None)
            uploaded = next(iter(self.uploading), None)
            if victim is None or uploaded is not None and (
                    now - self.waiting[victim] < self.grace
                    and self.uploading[uploaded] < self.waiting[victim]):
                victim = uploaded
            if victim is None:
                self.refused += 1
                return False
            self.evicted += 1
            victim.drop(None)
        self.open.add(conn)
        self.waiting[conn] = now
        return True

    def place(self, conn: Any, line: str | None) -> None:
        """`conn` is now `waiting`, `uploading` or busy (None); one that joins a line goes
        to its end."""
        if conn not in self.open:
            return
        if line == "waiting":
            self.waiting.setdefault(conn, time.monotonic())
        else:
            self.waiting.pop(conn, None)
        if line == "uploading":
            self.uploading.setdefault(conn, time.monotonic())
        else:
            self.uploading.pop(conn, None)

    def gone(self, conn: Any) -> None:
        self.open.discard(conn)
        self.waiting.pop(conn, None)
        self.uploading.pop(conn, None)


def guarded_protocol(connections: Connections) -> type[H11Protocol]:
    """uvicorn's h11 protocol, counted by `connections` and with its header and body
    timeouts (see the module's doc)."""

    class Guarded(H11Protocol):
        deadline: asyncio.TimerHandle | None = None
        deadline_for: str | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if not connections.admit(self):
                transport.write(BUSY_ANSWER)
                transport.close()
                return
            self._arm("headers")

        def connection_lost(self, exc: Exception | None) -> None:
            connections.gone(self)
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._follow()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._follow()

        def drop(self, answer: bytes | None) -> None:
            """Close the connection now (after `answer`, if any), whatever it was doing."""
            connections.gone(self)
            self._disarm()
            if not self.transport.is_closing():
                if answer is not None:
                    self.transport.write(answer)
                self.transport.close()

        def _follow(self) -> None:
            """Set the timer and the waiting state from where the request stands."""
            if self.transport.is_closing():
                return
            theirs = self.conn.their_state
            answering = self.cycle is not None and not self.cycle.response_complete
            if theirs is h11.SEND_BODY:
                connections.place(self, "uploading" if answering else "waiting")
                self._arm("body")
                return
            connections.place(self, None if answering else "waiting")
            if theirs is h11.IDLE and self.conn.trailing_data[0]:
                self._arm("headers")  # a request has begun: its headers' clock runs
            elif theirs is h11.IDLE and self.deadline_for == "headers" and \
                    self.cycle is None:
                pass  # no byte yet since the connection came: the first clock still runs
            else:
                self._disarm()  # answering, or idle (uvicorn's keep-alive timeout)

        def _arm(self, what: str) -> None:
            if self.deadline_for == what:
                return
            self._disarm()
            seconds = (connections.header_timeout if what == "headers"
                       else connections.body_timeout)
            self.deadline_for = what
            self.deadline = self.loop.call_later(seconds, self._expired, what)

        def _disarm(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
            self.deadline = self.deadline_for = None

        def _expired(self, what: str) -> None:
            self.deadline = self.deadline_for = None
            connections.timed_out += 1
            log.debug("HTTP connection from %s: its request's %s did not arrive in time",
                      self.client, what)
            self.drop(TIMEOUT_ANSWER if what == "headers" else None)

    return Guarded
