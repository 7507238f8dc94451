"""The request router's view of every Ray replica's radix tree: a thread that subscribes to
each replica's cache-events socket and keeps one `CacheView` per replica exact (a snapshot
over RPC when it joins or falls out of step), as radixserve's own router does
(router/view.py, router/replica.py). Ray-free: the replicas are named by strings.

The views are read and held (`hold`/`release`) by the router on Ray's event loop and
updated here: `lock` guards both."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

import msgspec
import zmq

from radixserve.client import Client
from radixserve.messages import CacheEvents, decode
from radixserve.router.view import CacheView
from radixserve.transport.cache_events import subscribe

log = logging.getLogger("ray.serve")

ROUTERS: weakref.WeakSet[Any] = weakref.WeakSet()
"""This process's request routers (router.py; one per deployment handle), for `describe`
(the ingress's GET /ray/router)."""


def describe() -> list[dict[str, Any]]:
    return [router.describe() for router in list(ROUTERS)]


class Tree:
    """One replica: its addresses (as its `record_replica_metadata` reports them), its
    subscription and its view."""

    def __init__(self, name: str, meta: dict[str, Any]) -> None:
        self.name = name
        self.rpc_address: str = meta["rpc_address"]
        self.events_address: str = meta["events_address"]
        self.page_size = int(meta["page_size"])
        self.view = CacheView()
        self.sub: zmq.Socket | None = None
        self.needs_snapshot = True
        self.next_try = 0.0
        """When a failed snapshot is asked again."""


class TreeFeed:
    def __init__(self, api_key: str | None, snapshot_timeout: float = 10.0) -> None:
        self.api_key = api_key
        self.snapshot_timeout = snapshot_timeout
        self.lock = threading.RLock()
        self.trees: dict[str, Tree] = {}
        self._adding: list[Tree] = []
        self._removing: list[str] = []
        self._stop = threading.Event()
        self._decoder = msgspec.msgpack.Decoder(CacheEvents)
        self._thread = threading.Thread(target=self._run, name="radixserve-ray-feed",
                                        daemon=True)
        self._thread.start()

    # -- from the router (Ray's loop) -----------------------------------------------------
    def ensure(self, name: str, meta: dict[str, Any]) -> Tree | None:
        """The tree of replica `name`, subscribed on first sight; None when its metadata
        does not name its addresses (not a radixserve replica, or not ready)."""
        tree = self.trees.get(name)
        if tree is not None:
            return tree
        if not {"rpc_address", "events_address", "page_size"} <= meta.keys():
            return None
        tree = Tree(name, meta)
        with self.lock:
            self.trees[name] = tree
            self._adding.append(tree)
        return tree

    def forget(self, names: set[str]) -> None:
        with self.lock:
            for name in names:
                if self.trees.pop(name, None) is not None:
                    self._removing.append(name)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    # -- the thread -----------------------------------------------------------------------
    def _run(self) -> None:
        ctx = zmq.Context()
        poller = zmq.Poller()
        subs: dict[zmq.Socket, Tree] = {}
        try:
            while not self._stop.is_set():
                with self.lock:
                    adding, self._adding = self._adding, []
                    removing, self._removing = set(self._removing), []
                for sock, tree in list(subs.items()):
                    if tree.name in removing:
                        poller.unregister(sock)
                        sock.close(linger=0)
                        del subs[sock]
                for tree in adding:
                    tree.sub = subscribe(ctx, tree.events_address, self.api_key)
                    subs[tree.sub] = tree
                    poller.register(tree.sub, zmq.POLLIN)
                for sock, _ in poller.poll(50):
                    tree = subs[sock]
                    try:
                        events = decode(self._decoder, sock.recv())
                    except msgspec.DecodeError:
                        log.warning("replica %s sent an undecodable event", tree.name)
                        continue
                    with self.lock:
                        if tree.view.on_events(events):
                            tree.needs_snapshot = True
                now = time.monotonic()
                for tree in list(subs.values()):
                    if tree.needs_snapshot and now >= tree.next_try:
                        self._snapshot(tree)
                    with self.lock:
                        tree.view.expire(now)
        finally:
            for sock in subs:
                sock.close(linger=0)
            ctx.destroy(linger=0)

    def _snapshot(self, tree: Tree) -> None:
        """The replica's whole tree, replacing the view (events that came since replay)."""
        try:
            with Client(tree.rpc_address, timeout=self.snapshot_timeout,
                        api_key=self.api_key) as client:
                snapshot = client.cache_snapshot()
        except Exception as e:  # gone or not ready: asked again in a second
            log.info("no snapshot from replica %s yet: %s", tree.name, e)
            tree.next_try = time.monotonic() + 1.0
            return
        with self.lock:
            tree.needs_snapshot = tree.view.on_snapshot(snapshot)
        log.debug("replica %s: its tree's view from a snapshot (%d pages), events from %s",
                 tree.name, len(tree.view.hashes), tree.events_address)
