"""One replica as the router sees it: its RPC link, its cache events, its health and load.

States: `joining` (connected; its model facts and a snapshot of its tree are on the way),
`ok` (routable), `dead` (it dropped its connection or stopped answering health checks; its
calls failed with `replica_died`; health checks go on, and a reply starts `joining`
again). A replica removed at run time closes its sockets and is forgotten.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import zmq

from radixserve.messages import ReplicaLoad
from radixserve.transport.cache_events import subscribe
from radixserve.router.view import CacheView


class Replica:
    def __init__(self, ctx: zmq.Context, url: str) -> None:
        self.url = url
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # A send with no connection up fails at once (EAGAIN) instead of queueing for a
        # replica that may never come back.
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # the router always reads; replicas too
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.connect(url)
        self.sub: zmq.Socket | None = None
        self.view = CacheView()
        self.load = ReplicaLoad()
        self.state = "joining"
        self.info: dict[str, Any] | None = None
        self.calls: set[int] = set()
        """Link call ids of the generate calls in flight here."""
        self.requests = 0
        self.tokens = 0
        """Requests and prompt tokens the router has in flight here (the replica's own
        report lags; the larger of the two counts)."""
        self.routed = 0
        self.health_sent: float | None = None
        """When the health check awaiting its answer was sent."""
        self.joining = False
        """A join (model_info, then a snapshot) is on its way."""
        self.last_answer = time.monotonic()
        self.died = 0

    @property
    def page_size(self) -> int:
        """The page size of its tree: the cache view's once it has one, else the model info's
        (a replica is routable only once it has answered that)."""
        if self.view.page_size:
            return self.view.page_size
        if self.info is None:
            raise RuntimeError(f"replica {self.url} has not joined")
        return int(self.info["page_size"])

    @property
    def routable(self) -> bool:
        return self.state == "ok"

    @property
    def busy_requests(self) -> int:
        return max(self.requests, self.load.waiting_requests + self.load.running_requests)

    @property
    def busy_tokens(self) -> int:
        return max(self.tokens, self.load.tokens)

    def events_address(self) -> str | None:
        """The replica's PUB endpoint: the port it reports, on the host we reach it at
        (it may report the interface it bound, e.g. 0.0.0.0)."""
        published = (self.info or {}).get("cache_events_address")
        if not published:
            return None
        if self.url.startswith("tcp://") and published.startswith("tcp://"):
            host = self.url[len("tcp://"):].rpartition(":")[0]
            return f"tcp://{host}:{published.rpartition(':')[2]}"
        return published

    def subscribe(self, ctx: zmq.Context, api_key: str | None) -> zmq.Socket | None:
        """Subscribe to its cache events with the replicas' operator key `api_key`."""
        self.unsubscribe()
        address = self.events_address()
        if address is None:
            return None
        self.sub = subscribe(ctx, address, api_key)
        return self.sub

    def unsubscribe(self) -> None:
        if self.sub is not None:
            self.sub.close(linger=0)
            self.sub = None

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "state": self.state, "routed": self.routed,
                "in_flight": len(self.calls), "requests": self.busy_requests,
                "tokens": self.busy_tokens, "cached_pages": len(self.view.hashes),
                "view_synced": self.view.synced, "deaths": self.died,
                "model_path": (self.info or {}).get("model_path")}

    def close(self) -> None:
        self.unsubscribe()
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


@dataclass
class Routed:
    """A generate call in flight at a replica, by the router's own call id on that link."""

    peer: bytes
    call_id: int
    replica: Replica
    stream: bool
    rids: list[str]
    """Its requests' rids, as the caller and the replica name them."""
    scoped: list[str]
    """The same, scoped by the tenant its key names (`scoped_rid`): its names in `rids`."""
    api_key: str | None
    """The key it was forwarded with: the router's aborts of it are made with it too."""
    requests: int
    tokens: int
    held: list[int]
    """Its prompts' page hashes, provisional in the replica's view until the call ends."""
