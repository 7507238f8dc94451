"""The connection as the socket's monitor reports it. ZeroMQ queues a call's frame and retries
the connection for ever, so without this a call to an address where nothing listens would
wait its whole timeout (600 s by default) and then say only that no reply came."""

from __future__ import annotations

import time

import zmq
from zmq.utils.monitor import parse_monitor_message

CONNECT_TIMEOUT = 5.0
"""Seconds a call waits while nothing is connected before it fails `disconnected`."""


class Link:
    """Whether the socket is connected, and since when it has not been."""

    EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
    """What the transports' monitor sockets report."""

    POLL_MS = 250
    """How often a transport looks again while calls wait with nothing connected."""

    def __init__(self, address: str, connect_timeout: float = CONNECT_TIMEOUT) -> None:
        self.address, self.connect_timeout = address, connect_timeout
        self.connected = False
        self._down_since = time.monotonic()

    def on_event(self, frames: list[bytes]) -> bool:
        """Note a monitor event; True when it is a dropped connection (the calls in flight
        on it get no answer)."""
        self.connected = parse_monitor_message(frames)["event"] == zmq.EVENT_CONNECTED
        if not self.connected:
            self._down_since = time.monotonic()
        return not self.connected

    def poll_ms(self, waiting: bool) -> int | None:
        """How long the transport's loop may sleep: for ever, unless calls are `waiting`
        with nothing connected."""
        return self.POLL_MS if waiting and not self.connected else None

    def unreachable(self) -> str | None:
        """Why the calls waiting now fail, once nothing has been connected for
        `connect_timeout`; None while there is still time (or a connection)."""
        if self.connected or time.monotonic() - self._down_since < self.connect_timeout:
            return None
        return (f"nothing answers at {self.address}: no connection for "
                f"{self.connect_timeout:g} s (is a server running there, and is the address "
                "right?)")
