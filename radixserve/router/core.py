"""The router's loop: one RPC front door over the replicas' RPC links.

A client's call is decoded (the server's wire schema and limits), checked (its key), and:
a generate call goes to the replica the policy picks from each replica's cache view and
load; its replies (chunks, the result, an error) come back under the client's call id,
the result marked with `meta_info["replica"]`. Health, model_info, stats and flush_cache
are answered for the whole fleet; `WorkersCall` (SGLang router's `/add_worker`) manages it.

Every call gets an answer: a replica that drops its connection or stops answering health
checks fails its calls in flight with `replica_died` at once; with no replica serving, a
call is answered `no_replica`. Validation of a generate call stays the replica's (it is
forwarded as it came), so a bad call gets the very error a server gives; the router checks
only what sizes its own work first (a batch's prompts). A replica's frame that does not
decode is that replica's fault: it is taken for dead, as one that drops its connection.

One thread, one zmq poller, no asyncio: the added latency per call is a decode, a
tokenization (for the page hashes), one set lookup per page and replica, and an encode.
Calls are dispatched here (`_handlers`); the fleet's health and joining are fleet.py's,
the fleet-wide answers (stats, flush, replicas, abort_all) fanout.py's.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections import Counter
from typing import Any, Callable

import msgspec
import zmq

from radixserve.cache.events import page_hashes
from radixserve.client.frames import bare_or_enveloped
from radixserve.messages import (OPERATOR_CALLS, AbortCall, CacheEvents, CacheInfoCall,
                                 CacheSnapshotCall, ChunkReply, ErrorReply, FlushCacheCall,
                                 GenerateCall, HealthCall, LoadLoraCall, LorasCall,
                                 ModelInfoCall, PinCall, ProfileCall, ResultReply, RpcCall,
                                 RpcReply, StatsCall, UnloadLoraCall, UnpinCall, WorkersCall,
                                 decode)
from radixserve.rids import NamingError, RidsInFlight, check_batch_size, name_prompts
from radixserve.router.config import RouterConfig
from radixserve.router.fanout import FanOut
from radixserve.router.fleet import Fleet
from radixserve.router.policy import Candidate, make_policy
from radixserve.router.prompts import call_rids, routed_prompts
from radixserve.router.replica import Replica, Routed
from radixserve.results.errors import ErrorCode
from radixserve.results.generate import GenerateResult
from radixserve.transport.replies import ClientReplies
from radixserve.transport.sockets import bind_rpc, bind_unbounded
from radixserve.tenants import (DEFAULT_TENANT, Tenants, check_cache_salt, forbidden_message,
                                load_cache_secret, namespace_of, parse_keys)

log = logging.getLogger(__name__)


class Router(Fleet, FanOut):
    def __init__(self, config: RouterConfig, tokenizer: Any) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.tenants = Tenants.from_config(config)
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
        self.rpc, self.rpc_address = bind_rpc(self.ctx, config.rpc_host, config.rpc_port,
                                              config.max_frame_bytes)
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
        self.rids: RidsInFlight[int] = RidsInFlight()
        """Calls in flight (link call ids) by their requests' scoped rids."""
        self.control: dict[int, tuple[Replica, Callable[[Any], None]]] = {}
        """Calls of the router's own (health, joins, fan-outs), by link call id."""
        self.reasons: Counter[str] = Counter()
        self.busy_seconds = {"route": 0.0, "relay": 0.0}
        """The router's own time on generate calls: choosing and forwarding them, and
        passing their replies back (what it adds to each call, besides the hops)."""
        self._handlers: dict[type, Callable[[bytes, Any], None]] = {
            GenerateCall: self._on_generate_timed, AbortCall: self._on_abort,
            ModelInfoCall: self._on_model_info, StatsCall: self._on_stats,
            FlushCacheCall: self._on_flush, WorkersCall: self._on_replicas,
            ProfileCall: self._replica_only, CacheSnapshotCall: self._replica_only,
            PinCall: self._replica_only, UnpinCall: self._replica_only,
            CacheInfoCall: self._replica_only, LoadLoraCall: self._on_lora,
            UnloadLoraCall: self._on_lora, LorasCall: self._on_lora}
        """How each call is served, by its type (health needs no key: `_on_call`'s)."""
        for url in config.replica:
            self.add_replica(url)

    def bind_local(self, address: str, gateway_key: str) -> None:
        """Also serve `address` (ipc) for the router's HTTP app, which authenticates with
        `gateway_key` (see FrontDoor.bind_local)."""
        self._gateway_key = gateway_key
        self.tenants.add_internal_key(gateway_key)
        bind_unbounded(self.rpc, address)

    # -- the fleet ----------------------------------------------------------------------
    # -- main loop ----------------------------------------------------------------------
    def serve(self, on_ready: Callable[[str], None], should_stop: Callable[[], bool]) -> None:
        on_ready(self.rpc_address)
        while not should_stop():
            self.poll_once()

    def poll_once(self) -> None:
        for sock, _ in self.poller.poll(10 if self.replies.backlog else 50):
            if sock is self.rpc:
                self.replies.receive(self.rpc.recv_multipart(copy=False), self.call_decoder,
                                     self._on_call, self.tenants.knows)
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
        if self.replies.backlog:
            self.replies.flush()
        self._check_health(time.monotonic())

    def close(self) -> None:
        for replica in self.replicas.values():
            replica.close()
        self.ctx.destroy(linger=0)

    # -- from clients -------------------------------------------------------------------
    def _on_call(self, peer: bytes, call: RpcCall) -> None:
        """Check the caller (its key; the operator's calls need the operator's), then
        dispatch by the call's type (`_handlers`)."""
        if isinstance(call, HealthCall):
            self.replies.send(peer, ResultReply(call.call_id, self._health()))
            return
        handler = self._handlers.get(type(call))
        if self.tenants.tenant_of(call.api_key) is None:
            self._error(peer, call.call_id, ErrorCode.UNAUTHORIZED, "invalid or missing api_key")
        elif isinstance(call, OPERATOR_CALLS) and not self.tenants.is_operator(call.api_key):
            self._error(peer, call.call_id, ErrorCode.FORBIDDEN,
                        forbidden_message(type(call).__struct_config__.tag))
        elif handler is None:  # every call gets an answer, even one this router does not know
            self._error(peer, call.call_id, ErrorCode.INVALID_REQUEST,
                        f"the router does not serve {type(call).__name__}")
        else:
            handler(peer, call)

    def _on_generate_timed(self, peer: bytes, call: GenerateCall) -> None:
        start = time.perf_counter()
        self._on_generate(peer, call)
        self.busy_seconds["route"] += time.perf_counter() - start

    def _on_abort(self, peer: bytes, call: AbortCall) -> None:
        if call.abort_all or call.tenant is not None:
            return self._on_abort_all(peer, call)
        key, scope = self._forwarded(call.api_key)
        link = self.rids.owner(scope, call.rid)
        if link is not None:  # passed on as its caller: the replica scopes it the same
            self._send(self.routed[link].replica, AbortCall(next(self.ids), call.rid, key))
        # The same answer either way: it must not tell whether a rid is in flight.
        self.replies.send(peer, ResultReply(call.call_id, {"aborted": call.rid}))

    def _replica_only(self, peer: bytes, call: ProfileCall | CacheSnapshotCall | PinCall
                      | UnpinCall | CacheInfoCall) -> None:
        """Pins and the cache view are of one replica's tree: the router holds only page
        hashes (no text to show) and cannot promise which replica a pinned prefix's later
        requests go to, so it names where to send them instead of guessing."""
        self._error(peer, call.call_id, ErrorCode.INVALID_REQUEST,
                    f"{type(call).__struct_config__.tag} is a replica's call: send it to a "
                    "replica's RPC address (list_workers names them), not to the router")

    def _on_generate(self, peer: bytes, call: GenerateCall) -> None:
        if (peer, call.call_id) in self.by_client:
            self._error(peer, call.call_id, ErrorCode.INVALID_REQUEST,
                        f"call_id {call.call_id} is already in flight")
            return
        key, tenant = self._forwarded(call.api_key)
        try:  # as a server says: its aborts would not know which call they mean
            self.rids.check_free(tenant, call_rids(call))
        except ValueError as e:
            self._error(peer, call.call_id, ErrorCode.INVALID_REQUEST, str(e))
            return
        call = msgspec.structs.replace(call, api_key=key)
        prompts = routed_prompts(call, self.tokenizer)
        try:  # before a rid or a page hash is made per prompt
            check_batch_size(len(prompts) if prompts is not None else 1)
        except ValueError as e:
            self._error(peer, call.call_id, ErrorCode.INVALID_REQUEST, str(e))
            return
        try:
            namespace = namespace_of(tenant, check_cache_salt(call.cache_salt), self.secret)
        except ValueError:
            namespace = None  # the replica names the bad salt
        if call.rid is None and prompts is not None:
            # A rid per prompt, so that a client gone mid-call can be aborted at the replica.
            try:
                named = name_prompts(call.text, call.input_ids, None, "router")
                call = msgspec.structs.replace(call, rid=named.rid_arg)
            except NamingError:
                pass  # a malformed call: the replica names what is wrong with it
        hashes: dict[int, list[list[int]]] = {}
        while True:
            ready = [r for r in self.replicas.values() if r.routable]
            if not ready:
                self._no_replica(peer, call.call_id)
                return
            candidates, by_name = [], {}
            for r in ready:
                page = r.page_size
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
        page = replica.page_size
        held = [h for hs in hashes.get(page, ()) for h in hs]
        replica.view.hold(held)
        rids = call_rids(call)
        routed = Routed(peer, call.call_id, replica, call.stream, rids,
                        self.rids.claim(tenant, rids, link), key,
                        len(prompts) if prompts is not None else 1, total, held)
        self.routed[link] = routed
        self.by_client[(peer, call.call_id)] = link
        replica.calls.add(link)
        replica.requests += routed.requests
        replica.tokens += routed.tokens
        replica.routed += 1

    # -- from replicas ------------------------------------------------------------------
    def _on_replica_reply(self, replica: Replica, reply: Any) -> None:
        """A reply is taken only from the replica its call went to: one naming another
        replica's call (a rogue or confused replica) is dropped and logged, never
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
        # The router's own calls are never streamed, and none generates: a reply that says
        # otherwise (a confused or rogue replica) is an error, not an answer to read.
        if isinstance(reply, ChunkReply) or isinstance(reply, ResultReply) and isinstance(
                reply.result, GenerateResult):
            reply = ErrorReply(reply.call_id, ErrorCode.INTERNAL, f"replica {replica.url} "
                               f"answered a control call with a {type(reply).__name__}")
        self.control.pop(reply.call_id)[1](reply)

    def _relay(self, replica: Replica, routed: Routed, reply: Any) -> None:
        if isinstance(reply, ChunkReply):
            self.replies.send(routed.peer, msgspec.structs.replace(reply, call_id=routed.call_id))
            return
        self._finish(reply.call_id)
        if isinstance(reply, ResultReply) and isinstance(reply.result, GenerateResult):
            # its outputs say which replica answered
            self.replies.send(routed.peer, ResultReply(
                routed.call_id, reply.result.with_replica(replica.url)))
            return
        if isinstance(reply, ResultReply):
            reply = ErrorReply(reply.call_id, ErrorCode.INTERNAL, f"replica {replica.url} "
                               "answered a generate call with something else")
        self.replies.send(routed.peer, msgspec.structs.replace(reply, call_id=routed.call_id))

    # -- plumbing -----------------------------------------------------------------------
    def _send(self, replica: Replica, call: Any) -> bool:
        try:
            replica.sock.send_multipart(bare_or_enveloped(
                self.encoder, call, self.encoder.encode(call)), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _control(self, replica: Replica, call: Any, callback: Callable[[Any], None]) -> None:
        self.control[call.call_id] = (replica, callback)
        if not self._send(replica, call):
            del self.control[call.call_id]
            callback(ErrorReply(call.call_id, ErrorCode.REPLICA_DIED, "no connection"))

    def _finish(self, link: int) -> None:
        routed = self.routed.pop(link)
        self.by_client.pop((routed.peer, routed.call_id), None)
        self.rids.release(routed.scoped, link)
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
                errors[call_id] = ErrorReply(call_id, ErrorCode.SLOW_READER, (
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

    def _error(self, peer: bytes, call_id: int, code: ErrorCode, message: str) -> None:
        self.replies.send(peer, ErrorReply(call_id, code, message))

    def _no_replica(self, peer: bytes, call_id: int) -> None:
        states = ", ".join(f"{r.url} {r.state}" for r in self.replicas.values()) or "none"
        self._error(peer, call_id, ErrorCode.NO_REPLICA,
                    f"no replica is serving (replicas: {states})")


def _first_key(config: RouterConfig) -> str | None:
    keys = parse_keys(config.api_key, config.api_keys_file)
    return next(iter(keys), None)
