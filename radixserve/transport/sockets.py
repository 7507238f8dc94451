"""Binding the servers' ZeroMQ sockets: the front door's and the router's alike."""

from __future__ import annotations

import ipaddress
from typing import Any

import zmq

from radixserve.tenants import Tenants


HANDSHAKE_MS = 10_000
"""A TCP connection that has not completed ZeroMQ's handshake within this is dropped: a
flood of silent connections holds the process's descriptors that long, not libzmq's
default 30 s."""


def bind_tcp(sock: zmq.Socket, host: str, port: int) -> str:
    """Bind `sock` on `host:port` (0: a free port) and return its `tcp://` address. Its
    connections must complete their handshake within HANDSHAKE_MS."""
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
    base = f"tcp://{host}"
    if port == 0:
        port = sock.bind_to_random_port(base)
    else:
        sock.bind(f"{base}:{port}")
    return f"{base}:{port}"


def bind_rpc(ctx: zmq.Context, host: str, port: int, max_frame_bytes: int,
             send_buffer: int | None = None) -> tuple[zmq.Socket, str]:
    """The ROUTER socket RPC clients talk to, bound on `host:port`, and its address. A send
    to a client that is gone raises. libzmq itself refuses a frame over `max_frame_bytes`:
    it reads the frame's size from its header, drops the connection and never buffers the
    frame (so no error reply can be sent; radixserve's clients refuse to send such a frame,
    and fail their calls in flight when the connection drops). The limit applies to every
    endpoint of the socket. `send_buffer`: its SO_SNDBUF (None: the system's)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.LINGER, 0)
    if send_buffer is not None:
        sock.setsockopt(zmq.SNDBUF, send_buffer)
    return sock, bind_tcp(sock, host, port)


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


def exposure_warning(config: Any) -> str | None:
    """What to warn of when a server or router (`config`: its ServerConfig or RouterConfig)
    listens beyond this machine, `host` or `rpc_host` not a loopback address, with no API
    key: every caller who can reach those ports may generate, abort and flush as it likes.
    None when it is safe to say nothing."""
    exposed = sorted({h for h in (config.host, config.rpc_host) if not _loopback(h)})
    if not exposed or Tenants.from_config(config).enabled:
        return None
    return (f"listening on {', '.join(exposed)} without an API key: anyone who can reach "
            "these ports can use it (set --api-key or --api-keys-file, or bind 127.0.0.1)")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name (or ZeroMQ's `*`): it may resolve beyond this machine
