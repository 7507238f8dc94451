"""The router's fleet: replicas added and removed, their health checked, a (re)joining
replica's cache view built (model_info, its events, a snapshot), a dead one's calls failed.

A part of `Router` (router/core.py), which owns the state it works on: the replicas, their
sockets in the poller, the calls in flight and the router's own control calls.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Callable

import zmq

from radixserve.messages import (CacheEvents, CacheSnapshotCall, ErrorReply, HealthCall,
                                 ModelInfoCall)
from radixserve.results.errors import ErrorCode
from radixserve.router.config import RouterConfig, check_replica_url
from radixserve.router.replica import Replica, Routed

log = logging.getLogger(__name__)


class Fleet:
    """The replicas' side of the router (a mixin of `Router`)."""

    # What it uses of `Router`, which sets and defines them.
    config: RouterConfig
    ctx: zmq.Context
    poller: zmq.Poller
    sockets: dict[zmq.Socket, tuple[str, Replica]]
    replicas: dict[str, Replica]
    routed: dict[int, Routed]
    control: dict[int, tuple[Replica, Callable[[Any], None]]]
    ids: itertools.count[int]
    replica_key: str | None
    replica_admin_key: str | None
    poll_once: Callable[[], None]
    _control: Callable[[Replica, Any, Callable[[Any], None]], None]
    _finish: Callable[[int], None]
    _send_aborts: Callable[[Routed], None]
    _error: Callable[[bytes, int, ErrorCode, str], None]

    def add_replica(self, url: str) -> Replica:
        check_replica_url(url)
        if url in self.replicas:
            raise ValueError(f"replica {url} is already a replica of this router")
        replica = self.replicas[url] = Replica(self.ctx, url)
        for kind, sock in (("rpc", replica.sock), ("monitor", replica.monitor)):
            self.sockets[sock] = (kind, replica)
            self.poller.register(sock, zmq.POLLIN)
        log.info("replica %s added", url)
        return replica

    def remove_replica(self, url: str) -> None:
        replica = self.replicas.pop(url, None)
        if replica is None:
            raise ValueError(f"replica {url} is not a replica of this router")
        self._fail_calls(replica, ErrorCode.REPLICA_REMOVED,
                         f"replica {url} was removed from the router")
        for sock in (replica.sock, replica.monitor, replica.sub):
            if sock is not None and sock in self.sockets:
                del self.sockets[sock]
                self.poller.unregister(sock)
        replica.close()
        log.info("replica %s removed", url)

    def wait_joined(self, timeout: float) -> None:
        """Serve until every replica given at start is routable; raise naming the ones
        that did not answer in `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while any(r.state != "ok" for r in self.replicas.values()):
            if time.monotonic() > deadline:
                missing = [r.url for r in self.replicas.values() if r.state != "ok"]
                raise RuntimeError(f"replica(s) {', '.join(missing)} did not answer in "
                                   f"{timeout:.0f}s (replica_timeout): is a radixserve server "
                                   "serving RPC there?")
            self.poll_once()


    def _on_events(self, replica: Replica, events: CacheEvents) -> None:
        replica.load = events.load
        replica.last_answer = time.monotonic()
        if replica.view.on_events(events) and replica.state == "ok":
            self._snapshot(replica)

    def _check_health(self, now: float) -> None:
        for replica in list(self.replicas.values()):
            replica.view.expire(now)
            if replica.state != "dead" and now - replica.last_answer > self.config.health_timeout:
                self._on_dead(replica, f"has not answered for {self.config.health_timeout:g}s "
                              "(health_timeout)")
            if replica.health_sent is not None and now - replica.health_sent < max(
                    self.config.health_timeout, 1.0):
                continue  # one check at a time; a lost one is re-sent after a while
            if replica.health_sent is None and now - replica.last_answer < (
                    self.config.health_interval) and replica.state == "ok":
                continue
            self._probe(replica, now)

    def _probe(self, replica: Replica, now: float) -> None:
        replica.health_sent = now

        def answered(reply: Any) -> None:
            replica.health_sent = None
            if isinstance(reply, ErrorReply) or reply.result.get("status") != "ok":
                if replica.state == "ok":  # e.g. its model process is restarting
                    replica.state = "unhealthy"
                return
            if replica.state in ("dead", "unhealthy"):
                replica.state = "joining"
            if replica.state == "joining" and not replica.joining:
                self._join(replica)

        self._control(replica, HealthCall(next(self.ids), self.replica_key), answered)

    def _join(self, replica: Replica) -> None:
        """model_info (for the events address), subscribe, then a snapshot of its tree."""
        replica.joining = True

        def info(reply: Any) -> None:
            if isinstance(reply, ErrorReply):
                replica.joining = False
                return
            replica.info = reply.result
            self._unsubscribe(replica)  # a restarted replica may publish on another port
            sub = replica.subscribe(self.ctx, self.replica_admin_key)
            if sub is not None:
                self.sockets[sub] = ("events", replica)
                self.poller.register(sub, zmq.POLLIN)
            self._snapshot(replica)

        self._control(replica, ModelInfoCall(next(self.ids), self.replica_key), info)

    def _snapshot(self, replica: Replica) -> None:
        def taken(reply: Any) -> None:
            replica.joining = False
            if isinstance(reply, ErrorReply) and reply.code in ("replica_died",
                                                                 "replica_removed"):
                return
            if isinstance(reply, ErrorReply):
                log.warning("replica %s gave no cache snapshot (%s): routing to it by load "
                            "only", replica.url, reply.message)
            elif replica.view.on_snapshot(reply.result):
                self._snapshot(replica)
                return
            if replica.state == "joining":
                replica.state = "ok"
                log.info("replica %s is serving (%d cached pages)", replica.url,
                         len(replica.view.hashes))

        self._control(replica, CacheSnapshotCall(next(self.ids), self.replica_admin_key),
                      taken)

    def _on_dead(self, replica: Replica, why: str) -> None:
        if replica.state == "dead":
            return
        if replica.state == "joining" and not replica.died and not replica.calls:
            log.warning("replica %s %s", replica.url, why)  # it never served
        else:
            log.warning("replica %s %s: failing its %d call(s) in flight", replica.url, why,
                        len(replica.calls))
        replica.state = "dead"
        replica.died += 1
        replica.joining = False
        replica.health_sent = None
        replica.load = type(replica.load)()
        for link in replica.calls:  # in case it is only hung: free what it holds for them
            self._send_aborts(self.routed[link])
        self._fail_calls(replica, ErrorCode.REPLICA_DIED, f"replica {replica.url} {why}")
        self._unsubscribe(replica)
        replica.view.reset()

    def _unsubscribe(self, replica: Replica) -> None:
        if replica.sub is not None and replica.sub in self.sockets:
            del self.sockets[replica.sub]
            self.poller.unregister(replica.sub)
        replica.unsubscribe()

    def _fail_calls(self, replica: Replica, code: ErrorCode, message: str) -> None:
        for link in list(replica.calls):
            routed = self.routed[link]
            self._finish(link)
            self._error(routed.peer, routed.call_id, code, message)
        for link, (owner, callback) in list(self.control.items()):
            if owner is replica:
                del self.control[link]
                callback(ErrorReply(link, code, message))

