"""The router's loop: one RPC front door over the replicas' RPC links.

A client's call is decoded (the server's wire schema and limits), checked (its key), and:
a generate call goes to the replica the policy picks from each replica's cache view and
load; its replies (chunks, the result, an error) come back under the client's call id,
the result marked with `meta_info["replica"]`. Health, model_info, stats and flush_cache
are answered for the whole fleet; workers (add, remove, list) manage it.

Every call gets an answer: a replica that drops its connection or stops answering health
checks fails its calls in flight with `replica_died` at once; with no replica serving, a
call is answered `no_replica`. Validation of a generate call stays the replica's (it is
forwarded as it came), so a bad call gets the very error a server gives; the router checks
only what sizes its own work first (a batch's prompts). A replica's frame that does not
decode is that replica's fault: it is taken for dead, as one that drops its connection.

One thread, one zmq poller, no asyncio: the added latency per call is a decode, a
tokenization (for the page hashes), one set lookup per page and replica, and an encode.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import msgspec
import zmq

from radixserve.cache.events import page_hashes
from radixserve.messages import (OPERATOR_CALLS, AbortCall, CacheEvents, CacheInfoCall,
                                 CacheSnapshotCall, ChunkReply, ErrorReply, FlushCacheCall,
                                 GenerateCall, HealthCall, ModelInfoCall, PinCall, ProfileCall,
                                 ResultReply, RpcCall, RpcReply, StatsCall, UnpinCall,
                                 WorkersCall, decode)
from radixserve.results.generate import GenerateResult
from radixserve.server.replies import ClientReplies
from radixserve.server.sockets import bind_tcp, bind_unbounded
from radixserve.tenants import (DEFAULT_TENANT, Tenants, check_cache_salt, forbidden_message,
                                load_cache_secret, namespace_of, scoped_rid)
from radixserve.tokenizer.requests import check_batch_size
from radixserve.router.config import RouterConfig, check_replica_url
from radixserve.router.policy import Candidate, make_policy
from radixserve.router.replica import Replica

log = logging.getLogger(__name__)
MAX_ROUTED_CHARS = 1 << 20
"""A longer text prompt is not tokenized for routing (the replica refuses it anyway)."""


@dataclass
class Routed:
    """A generate call in flight at a replica, by the router's own call id on that link."""

    peer: bytes
    call_id: int
    replica: Replica
    stream: bool
    rids: list[str]
    tenant: str
    """Its rids' scope (`scoped_rid`): the tenant its key names."""
    api_key: str | None
    """The key it was forwarded with: the router's aborts of it are made with it too."""
    requests: int
    tokens: int
    held: list[int]
    """Its prompts' page hashes, provisional in the replica's view until the call ends."""


class Router:
    def __init__(self, config: RouterConfig, tokenizer: Any) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.tenants = Tenants.from_config(config.api_key, config.api_keys_file,
                                           config.admin_api_key)
        self.replica_key = _first_key(config)
        self.replica_admin_key = (config.replica_admin_key or config.admin_api_key
                                  or self.replica_key)
        """For the replicas' operator calls: snapshots, events, flushes."""
        self.secret = load_cache_secret(config.cache_secret_file)
        if config.cache_secret_file is None and config.policy == "cache_aware":
            log.warning("no --cache-secret-file: the router cannot hash prompts as the "
                        "replicas do, and routes by load only")
        self._gateway_key: str | None = None
        self.policy = make_policy(config)
        self.ctx = zmq.Context()
        self.rpc = self.ctx.socket(zmq.ROUTER)
        self.rpc.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.rpc.setsockopt(zmq.MAXMSGSIZE, config.max_frame_bytes)
        self.rpc.setsockopt(zmq.LINGER, 0)
        self.rpc_address = bind_tcp(self.rpc, config.rpc_host, config.rpc_port)
        self.replies = ClientReplies(self.rpc, config.max_client_backlog, self._on_gone,
                                     self._on_slow_reader)
        self.encoder = msgspec.msgpack.Encoder()
        self.call_decoder = msgspec.msgpack.Decoder(RpcCall)
        self.reply_decoder = msgspec.msgpack.Decoder(RpcReply)
        self.events_decoder = msgspec.msgpack.Decoder(CacheEvents)
        self.poller = zmq.Poller()
        self.poller.register(self.rpc, zmq.POLLIN)
        self.sockets: dict[zmq.Socket, tuple[str, Replica]] = {}
        self.replicas: dict[str, Replica] = {}
        self.ids = itertools.count(1)
        self.routed: dict[int, Routed] = {}
        self.by_client: dict[tuple[bytes, int], int] = {}
        self.by_rid: dict[str, int] = {}
        """Calls in flight by their requests' scoped rids (`scoped_rid`)."""
        self.control: dict[int, tuple[Replica, Callable[[Any], None]]] = {}
        """Calls of the router's own (health, joins, fan-outs), by link call id."""
        self.reasons: Counter[str] = Counter()
        self.busy_seconds = {"route": 0.0, "relay": 0.0}
        """The router's own time on generate calls: choosing and forwarding them, and
        passing their replies back (what it adds to each call, besides the hops)."""
        for url in config.replica:
            self.add_replica(url)

    def bind_local(self, address: str, gateway_key: str) -> None:
        """Also serve `address` (ipc) for the router's HTTP app, which authenticates with
        `gateway_key` (see FrontDoor.bind_local)."""
        self._gateway_key = gateway_key
        self.tenants.add_internal_key(gateway_key)
        bind_unbounded(self.rpc, address)

    # -- the fleet ----------------------------------------------------------------------
    def add_replica(self, url: str) -> Replica:
        check_replica_url(url)
        if url in self.replicas:
            raise ValueError(f"replica {url} is already a worker of this router")
        replica = self.replicas[url] = Replica(self.ctx, url)
        for kind, sock in (("rpc", replica.sock), ("monitor", replica.monitor)):
            self.sockets[sock] = (kind, replica)
            self.poller.register(sock, zmq.POLLIN)
        log.info("replica %s added", url)
        return replica

    def remove_replica(self, url: str) -> None:
        replica = self.replicas.pop(url, None)
        if replica is None:
            raise ValueError(f"replica {url} is not a worker of this router")
        self._fail_calls(replica, "replica_removed", f"replica {url} was removed from the router")
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

    # -- main loop ----------------------------------------------------------------------
    def serve(self, on_ready: Callable[[str], None], should_stop: Callable[[], bool]) -> None:
        on_ready(self.rpc_address)
        while not should_stop():
            self.poll_once()

    def poll_once(self) -> None:
        for sock, _ in self.poller.poll(10 if self.replies.pending else 50):
            if sock is self.rpc:
                self.replies.receive(self.rpc.recv_multipart(copy=False), self.call_decoder,
                                     self._on_call)
                continue
            entry = self.sockets.get(sock)
            if entry is None:  # its replica was removed while this batch was polled
                continue
            kind, replica = entry
            if kind == "monitor":
                sock.recv_multipart()
                self._on_dead(replica, "dropped its connection")
                continue
            try:
                message = decode(self.reply_decoder if kind == "rpc" else self.events_decoder,
                                 sock.recv())
            except msgspec.DecodeError as e:  # the replica's fault, not the router's
                self._on_dead(replica, f"sent an undecodable {kind} frame ({e})")
                continue
            if kind == "rpc":
                self._on_replica_reply(replica, message)
            else:
                self._on_events(replica, message)
        if self.replies.pending:
            self.replies.flush()
        self._check_health(time.monotonic())

    def close(self) -> None:
        for replica in self.replicas.values():
            replica.close()
        self.ctx.destroy(linger=0)

    # -- from clients -------------------------------------------------------------------
    def _on_call(self, peer: bytes, call: Any) -> None:
        if isinstance(call, HealthCall):
            self.replies.send(peer, ResultReply(call.call_id, self._health()))
            return
        tenant = self.tenants.tenant_of(call.api_key)
        if tenant is None:
            self._error(peer, call.call_id, "unauthorized", "invalid or missing api_key")
        elif isinstance(call, OPERATOR_CALLS) and not self.tenants.is_operator(call.api_key):
            self._error(peer, call.call_id, "forbidden",
                        forbidden_message(type(call).__struct_config__.tag))
        elif isinstance(call, GenerateCall):
            start = time.perf_counter()
            self._on_generate(peer, call)
            self.busy_seconds["route"] += time.perf_counter() - start
        elif isinstance(call, AbortCall):
            key, scope = self._forwarded(call.api_key)
            link = self.by_rid.get(scoped_rid(scope, call.rid))
            if link is not None:  # passed on as its caller: the replica scopes it the same
                self._send(self.routed[link].replica, AbortCall(next(self.ids), call.rid, key))
            # The same answer either way: it must not tell whether a rid is in flight.
            self.replies.send(peer, ResultReply(call.call_id, {"aborted": call.rid}))
        elif isinstance(call, ModelInfoCall):
            info = next((r.info for r in self.replicas.values() if r.routable), None)
            if info is None:
                self._no_replica(peer, call.call_id)
            else:
                self.replies.send(peer, ResultReply(call.call_id, {
                    **info, "router": {"policy": self.config.policy,
                                       "replicas": len(self.replicas)}}))
        elif isinstance(call, StatsCall):
            self._fan_out(peer, call.call_id, lambda: StatsCall(next(self.ids), self.replica_key),
                          self._combine_stats)
        elif isinstance(call, FlushCacheCall):
            self._fan_out(peer, call.call_id,
                          lambda: FlushCacheCall(next(self.ids), self.replica_admin_key),
                          lambda results: {"flushed": all(r.get("flushed") for r in
                                                          results.values())})
        elif isinstance(call, WorkersCall):
            self._on_workers(peer, call)
        elif isinstance(call, (ProfileCall, CacheSnapshotCall, PinCall, UnpinCall,
                               CacheInfoCall)):
            # Pins and the cache view are of one replica's tree: the router holds only page
            # hashes (no text to show) and cannot promise which replica a pinned prefix's
            # later requests go to, so it names where to send them instead of guessing.
            what = {ProfileCall: "profile", CacheSnapshotCall: "cache_snapshot",
                    PinCall: "pin", UnpinCall: "unpin", CacheInfoCall: "cache_info"}[type(call)]
            self._error(peer, call.call_id, "invalid_request",
                        f"{what} is a replica's call: send it to a replica's RPC address "
                        "(list_workers names them), not to the router")
        else:  # every call gets an answer, even one this router does not know yet
            self._error(peer, call.call_id, "invalid_request",
                        f"the router does not serve {type(call).__name__}")

    def _on_generate(self, peer: bytes, call: GenerateCall) -> None:
        if (peer, call.call_id) in self.by_client:
            self._error(peer, call.call_id, "invalid_request",
                        f"call_id {call.call_id} is already in flight")
            return
        key, tenant = self._forwarded(call.api_key)
        taken = [r for r in _rids(call) if scoped_rid(tenant, r) in self.by_rid]
        if taken:  # as a server says: its aborts would not know which call they mean
            self._error(peer, call.call_id, "invalid_request",
                        f"rid {taken[0]!r} is already in use")
            return
        call = msgspec.structs.replace(call, api_key=key)
        prompts = self._prompts(call)
        try:  # before a rid or a page hash is made per prompt
            check_batch_size(len(prompts) if prompts is not None else 1)
        except ValueError as e:
            self._error(peer, call.call_id, "invalid_request", str(e))
            return
        try:
            namespace = namespace_of(tenant, check_cache_salt(call.cache_salt), self.secret)
        except ValueError:
            namespace = None  # the replica names the bad salt
        if call.rid is None and prompts is not None:
            # A rid per prompt, so that a client gone mid-call can be aborted at the replica.
            rids = [f"router-{uuid.uuid4().hex}" for _ in prompts]
            call = msgspec.structs.replace(call, rid=rids[0] if _single(call) else rids)
        hashes: dict[int, list[list[int]]] = {}
        while True:
            ready = [r for r in self.replicas.values() if r.routable]
            if not ready:
                self._no_replica(peer, call.call_id)
                return
            candidates, by_name = [], {}
            for r in ready:
                page = r.view.page_size or r.info["page_size"]
                if prompts is not None and page not in hashes:
                    hashes[page] = [page_hashes(p, page, namespace, key=self.secret)
                                    for p in prompts]
                matched = sum(r.view.matched_pages(h) for h in hashes.get(page, ())) * page
                candidates.append(Candidate(r.url, matched, r.busy_requests, r.busy_tokens,
                                            len(r.view.hashes)))
                by_name[r.url] = r
            total = sum(len(p) for p in prompts) if prompts is not None else 0
            choice = self.policy.choose(candidates, total)
            replica = by_name[choice.name]
            link = next(self.ids)
            if self._send(replica, msgspec.structs.replace(call, call_id=link)):
                break
            self._on_dead(replica, "refused a send (no connection)")
        self.reasons[choice.reason] += 1
        page = replica.view.page_size or replica.info["page_size"]
        held = [h for hs in hashes.get(page, ()) for h in hs]
        replica.view.hold(held)
        rids = _rids(call)
        routed = Routed(peer, call.call_id, replica, call.stream, rids, tenant, key,
                        len(prompts) if prompts is not None else 1, total, held)
        self.routed[link] = routed
        self.by_client[(peer, call.call_id)] = link
        for rid in rids:
            self.by_rid[scoped_rid(tenant, rid)] = link
        replica.calls.add(link)
        replica.requests += routed.requests
        replica.tokens += routed.tokens
        replica.routed += 1

    def _prompts(self, call: GenerateCall) -> list[list[int]] | None:
        """The call's prompts as the replica will tokenize them; None when they cannot be
        told (a malformed call: the replica will say what is wrong with it)."""
        if call.text is not None:
            texts = [call.text] if isinstance(call.text, str) else call.text
            if not texts or sum(len(t) for t in texts) > MAX_ROUTED_CHARS:
                return None
            return [self.tokenizer.encode(t) for t in texts]
        ids = call.input_ids
        if not ids:
            return None
        if all(type(t) is int for t in ids):
            return [ids]  # type: ignore[list-item]
        if all(isinstance(t, list) for t in ids):
            return ids  # type: ignore[return-value]
        return None

    def _on_workers(self, peer: bytes, call: WorkersCall) -> None:
        if call.action == "list":
            self.replies.send(peer, ResultReply(call.call_id, {
                "workers": [r.describe() for r in self.replicas.values()],
                "policy": self.config.policy, "routed_by_reason": dict(self.reasons),
                "routed": sum(self.reasons.values()), "busy_seconds": dict(self.busy_seconds)}))
            return
        try:
            if call.url is None:
                raise ValueError(f"{call.action}_worker needs the replica's url")
            if call.action == "add":
                self.add_replica(call.url)
            else:
                self.remove_replica(call.url)
        except ValueError as e:
            self._error(peer, call.call_id, "invalid_request", str(e))
            return
        done = "added" if call.action == "add" else "removed"
        self.replies.send(peer, ResultReply(call.call_id, {done: call.url}))

    def _health(self) -> dict[str, Any]:
        ok = any(r.routable for r in self.replicas.values())
        return {"status": "ok" if ok else "no_replica", "pids": {"router": os.getpid()},
                "replicas": {r.url: r.state for r in self.replicas.values()}}

    # -- from replicas ------------------------------------------------------------------
    def _on_replica_reply(self, replica: Replica, reply: Any) -> None:
        """A reply is taken only from the replica its call went to: one naming another
        replica's call (a rogue or confused worker) is dropped and logged, never
        delivered."""
        replica.last_answer = time.monotonic()
        routed = self.routed.get(reply.call_id)
        control = self.control.get(reply.call_id)
        owner = routed.replica if routed is not None else control[0] if control else None
        if owner is None:  # a call nobody waits for now (an abort's answer, a failed call)
            return
        if owner is not replica:
            log.warning("replica %s answered call %d, which went to %s: dropped",
                        replica.url, reply.call_id, owner.url)
            return
        if routed is not None:
            start = time.perf_counter()
            self._relay(replica, routed, reply)
            self.busy_seconds["relay"] += time.perf_counter() - start
            return
        if isinstance(reply, ChunkReply):  # the router's own calls are never streamed
            reply = ErrorReply(reply.call_id, "internal",
                               f"replica {replica.url} answered a control call with a chunk")
        self.control.pop(reply.call_id)[1](reply)

    def _relay(self, replica: Replica, routed: Routed, reply: Any) -> None:
        if isinstance(reply, ChunkReply):
            self.replies.send(routed.peer, msgspec.structs.replace(reply, call_id=routed.call_id))
            return
        self._finish(reply.call_id)
        if isinstance(reply, ResultReply):
            result = reply.result  # a generate call's outputs say which replica answered
            if isinstance(result, GenerateResult):
                result = result.with_replica(replica.url)
            self.replies.send(routed.peer, ResultReply(routed.call_id, result))
        else:
            self.replies.send(routed.peer, msgspec.structs.replace(reply, call_id=routed.call_id))

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
                if replica.state == "ok":  # e.g. its worker is restarting
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
        self._fail_calls(replica, "replica_died", f"replica {replica.url} {why}")
        self._unsubscribe(replica)
        replica.view.reset()

    def _unsubscribe(self, replica: Replica) -> None:
        if replica.sub is not None and replica.sub in self.sockets:
            del self.sockets[replica.sub]
            self.poller.unregister(replica.sub)
        replica.unsubscribe()

    def _fail_calls(self, replica: Replica, code: str, message: str) -> None:
        for link in list(replica.calls):
            routed = self.routed[link]
            self._finish(link)
            self._error(routed.peer, routed.call_id, code, message)
        for link, (owner, callback) in list(self.control.items()):
            if owner is replica:
                del self.control[link]
                callback(ErrorReply(link, code, message))

    # -- plumbing -----------------------------------------------------------------------
    def _send(self, replica: Replica, call: Any) -> bool:
        try:
            replica.sock.send(self.encoder.encode(call), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _control(self, replica: Replica, call: Any, callback: Callable[[Any], None]) -> None:
        self.control[call.call_id] = (replica, callback)
        if not self._send(replica, call):
            del self.control[call.call_id]
            callback(ErrorReply(call.call_id, "replica_died", "no connection"))

    def _fan_out(self, peer: bytes, call_id: int, make: Callable[[], Any],
                 combine: Callable[[dict[str, Any]], Any]) -> None:
        targets = [r for r in self.replicas.values() if r.routable]
        if not targets:
            self._no_replica(peer, call_id)
            return
        results: dict[str, Any] = {}

        def one(replica: Replica, reply: Any) -> None:
            results[replica.url] = reply
            if len(results) < len(targets):
                return
            error = next((r for r in results.values() if isinstance(r, ErrorReply)), None)
            if error is not None:
                self._error(peer, call_id, error.code, error.message)
            else:
                self.replies.send(peer, ResultReply(call_id, combine(
                    {url: r.result for url, r in results.items()})))

        for replica in targets:
            self._control(replica, make(), lambda reply, r=replica: one(r, reply))

    def _combine_stats(self, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """The fleet's totals (what a server's stats count, summed), and each replica's."""
        total: dict[str, Any] = {}
        for stats in results.values():
            for key, value in stats.items():
                if key == "page_size":  # a setting, not a count
                    total.setdefault(key, value)
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    total[key] = total.get(key, 0) + value
        looked_up = total.get("hit_tokens", 0) + total.get("miss_tokens", 0)
        if "hit_rate" in total:
            total["hit_rate"] = total["hit_tokens"] / looked_up if looked_up else 0.0
        return {**total, "replicas": results,
                "router": {"policy": self.config.policy, "routed_by_reason": dict(self.reasons),
                           "workers": [r.describe() for r in self.replicas.values()]}}

    def _finish(self, link: int) -> None:
        routed = self.routed.pop(link)
        self.by_client.pop((routed.peer, routed.call_id), None)
        for rid in routed.rids:
            if self.by_rid.get(scoped_rid(routed.tenant, rid)) == link:
                del self.by_rid[scoped_rid(routed.tenant, rid)]
        replica = routed.replica
        replica.calls.discard(link)
        replica.requests -= routed.requests
        replica.tokens -= routed.tokens
        replica.view.release(routed.held, time.monotonic())

    def _on_gone(self, peer: bytes) -> None:
        for (owner, _), link in list(self.by_client.items()):
            if owner == peer:
                self._abort(link)

    def _on_slow_reader(self, peer: bytes) -> dict[int, ErrorReply]:
        errors = {}
        for (owner, call_id), link in list(self.by_client.items()):
            if owner == peer and self.routed[link].stream:
                self._abort(link)
                errors[call_id] = ErrorReply(call_id, "slow_reader", (
                    "the stream was ended: the client read its replies too slowly, and more "
                    f"than max_client_backlog={self.config.max_client_backlog} "
                    "(--max-client-backlog) waited for it"))
        return errors

    def _abort(self, link: int) -> None:
        self._send_aborts(self.routed[link])
        self._finish(link)

    def _send_aborts(self, routed: Routed) -> None:
        """Abort a call's requests at its replica as their caller (its key's tenant scopes
        their rids there: another key's abort would not reach them)."""
        for rid in routed.rids:
            self._send(routed.replica, AbortCall(next(self.ids), rid, routed.api_key))

    def _forwarded(self, api_key: str | None) -> tuple[str | None, str]:
        """The key a call is passed on with (the caller's own, but for the router's HTTP
        app, whose credential only the router knows) and the tenant it names, which scopes
        the call's rids here as at the replica."""
        key = api_key
        if self._gateway_key is not None and api_key is not None and secrets.compare_digest(
                api_key.encode(), self._gateway_key.encode()):
            key = self.replica_key
        return key, self.tenants.tenant_of(key) or DEFAULT_TENANT

    def _error(self, peer: bytes, call_id: int, code: str, message: str) -> None:
        self.replies.send(peer, ErrorReply(call_id, code, message))

    def _no_replica(self, peer: bytes, call_id: int) -> None:
        states = ", ".join(f"{r.url} {r.state}" for r in self.replicas.values()) or "none"
        self._error(peer, call_id, "no_replica", f"no replica is serving (workers: {states})")


def _rids(call: GenerateCall) -> list[str]:
    return [] if call.rid is None else [call.rid] if isinstance(call.rid, str) else list(call.rid)


def _single(call: GenerateCall) -> bool:
    if call.text is not None:
        return isinstance(call.text, str)
    return not (call.input_ids and isinstance(call.input_ids[0], list))


def _first_key(config: RouterConfig) -> str | None:
    from radixserve.tenants import parse_keys
    keys = parse_keys(config.api_key, config.api_keys_file)
    return next(iter(keys), None)
