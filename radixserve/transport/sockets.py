"""Binding the servers' ZeroMQ sockets: the front door's and the router's alike."""

from __future__ import annotations

import ipaddress
from typing import Any

import zmq

from radixserve.tenants import Tenants


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
