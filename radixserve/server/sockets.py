"""Binding the servers' ZeroMQ sockets: the front door's and the router's alike."""

from __future__ import annotations

import zmq


def bind_tcp(sock: zmq.Socket, host: str, port: int) -> str:
    """Bind `sock` on `host:port` (0: a free port) and return its `tcp://` address."""
    base = f"tcp://{host}"
    if port == 0:
        port = sock.bind_to_random_port(base)
    else:
        sock.bind(f"{base}:{port}")
    return f"{base}:{port}"


def bind_unbounded(sock: zmq.Socket, address: str) -> None:
    """Also bind `sock` on `address` with no send high-water mark, for one local client
    that multiplexes many callers over one connection and always reads (an HTTP server):
    at the default mark (1000 frames), a burst of tokens for a few hundred HTTP streams
    would fail a send and be taken for a client gone, aborting them all. libzmq copies the
    option into each listener at bind time, so the socket's other endpoints keep theirs."""
    default = sock.getsockopt(zmq.SNDHWM)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.bind(address)
    sock.setsockopt(zmq.SNDHWM, default)
