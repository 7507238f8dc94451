"""Where the scheduler's CacheEvents go from the front door: the cache-events socket (page
hashes and load, for radixserve's router; transport/cache_events.py) and, with
`--kv-events`, vLLM's KV-event sockets (transport/kv_events.py). Both live in the front
door, so that subscribers stay connected across scheduler restarts.

Off is free: with nobody subscribed to the cache events and no `--kv-events`, a step's
events are not re-encoded (`wanted`); the scheduler still sends them, as its heartbeat
(front_door/liveness.py)."""

from __future__ import annotations

import msgspec
import zmq

from radixserve.config import ServerConfig
from radixserve.messages import CacheEvents
from radixserve.tenants import Tenants
from radixserve.transport.cache_events import EventsPublisher, Subscriptions
from radixserve.transport.kv_events import KVEventsPublisher


class TreeEventsOut:
    def __init__(self, config: ServerConfig, tenants: Tenants) -> None:
        self.cache_events = EventsPublisher(tenants, config.rpc_host, config.cache_events_port,
                                            zmq.XPUB)
        self.subscriptions = Subscriptions(self.cache_events.sock)
        """The front door's poller waits on its socket, and calls `take_subscriptions`."""
        self.kv_events = None if config.kv_events == "off" else KVEventsPublisher(
            tenants, config.rpc_host, config.kv_events_port, config.kv_events_replay_port,
            config.kv_events_topic)
        self.replay: zmq.Socket | None = None if self.kv_events is None else self.kv_events.replay
        """vLLM's replay requests come here (with `--kv-events` only): the front door's poller
        also waits on it, and calls `serve_replay` when it is readable."""
        self.addresses = {"cache_events_address": self.cache_events.address}
        """Where the events are published, for `model_info` (vLLM's with `kv_events` only)."""
        if self.kv_events is not None:
            self.addresses["kv_events_address"] = self.kv_events.address
            self.addresses["kv_events_replay_address"] = self.kv_events.replay_address
        self.encoder = msgspec.msgpack.Encoder()
        self.wanted = self.kv_events is not None
        """Whether `publish` has anywhere to send (vLLM's events are kept for replay)."""

    def take_subscriptions(self) -> None:
        self.subscriptions.take()
        self.wanted = self.kv_events is not None or self.subscriptions.any

    def publish(self, msg: CacheEvents) -> None:
        """Called only while `wanted`. Re-encoded rather than relayed raw: only a frame
        that decoded as CacheEvents reaches subscribers. A PUB send never blocks (past
        SNDHWM it drops)."""
        if self.kv_events is not None:
            self.kv_events.publish(msg)
            msg.blocks = []  # vLLM's events go on their own socket only
        self.cache_events.sock.send(self.encoder.encode(msg))

    def serve_replay(self) -> KVEventsPublisher | None:
        """Serve the replay request `replay` has; when it needs the scheduler's whole tree,
        where the answer to `CacheSnapshotCall(blocks=True)` goes (else None)."""
        kv = self.kv_events
        assert kv is not None  # `replay` is None without it
        return kv if kv.serve_replay() else None

    def close(self) -> None:
        self.cache_events.close()
        if self.kv_events is not None:
            self.kv_events.close()
