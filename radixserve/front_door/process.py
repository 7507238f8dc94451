"""The front door (`radixserve-front-door`, the process `serve` runs in): RPC and HTTP calls,
tokenization, per-request state, detokenization, streaming.

It owns the ROUTER socket clients talk to, tokenizes and validates their calls, forwards
requests to the scheduler process, turns the scheduler's token updates into text (chunks
for streams, one result otherwise) and watches the scheduler and worker processes: if one
dies, every call in flight gets an error at once and both are restarted.

Every call but health carries a key naming its caller's tenant (tenants.py): a generate
call's requests get the cache namespace of (tenant, `cache_salt`), rids are scoped by
tenant (rids.py), and the operator's calls (`OPERATOR_CALLS`) need the operator's key. A
generate call naming a LoRA adapter that is not loaded is refused whole (lora_calls.py).
The HTTP server, a thread of this process, reaches the handlers without a socket
(transport/in_process.py): each of its calls comes with the sink its replies go to, where a
socket's client has its routing id (`Peer`), and carries its HTTP caller's own key. A call
of many prompt characters is tokenized off the loop, in its tenant's turn (tokenizing.py).
CacheEvents from the scheduler are published on the front door's own sockets
(front_door/tree_events.py), so that subscribers stay connected across restarts.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable, Iterable

import msgspec
import zmq

from radixserve.config import ServerConfig
from radixserve.messages import (AbortCall, CacheEvents, CacheInfoCall, CacheSnapshotCall, Caller,
                                 ChunkReply, Control, ControlOp, ControlReply, ErrorReply,
                                 FlushCacheCall, GenerateCall, HealthCall, LoadLoraCall,
                                 LorasCall, ModelInfoCall, OPERATOR_CALLS, PinCall,
                                 ProfileCall, RequestRejected, UnloadLoraCall, WorkersCall,
                                 ResultReply, RpcCall, SchedulerOutput, SchedulerReady, StatsCall,
                                 UnpinCall, TokenizedRequest, UpdateBatch, WorkerInfo,
                                 decode)
from radixserve.results.errors import ErrorCode
from radixserve.rids import RidsInFlight
from radixserve.front_door import admin
from radixserve.front_door.admin import Who
from radixserve.transport.in_process import InProcessCalls, ReplySink
from radixserve.transport.replies import ClientReplies, dispatch
from radixserve.transport.sockets import bind_rpc
from radixserve.tenants import Tenants, forbidden_message, namespace_of
from radixserve.front_door.cache_calls import CacheCalls
from radixserve.front_door.control_calls import ControlCalls, Shape
from radixserve.front_door.liveness import Children, SchedulerProgress, watch_children
from radixserve.front_door.lora_calls import LoraCall, LoraCalls
from radixserve.front_door.output import Call
from radixserve.front_door.requests import build_call, check_call_chars
from radixserve.front_door.tokenizing import INLINE_CHARS, WAITING_FULL, Tokenizing
from radixserve.front_door.tree_events import TreeEventsOut

log = logging.getLogger(__name__)

Peer = bytes | ReplySink
"""Who a call came from, and where its replies go: an RPC client's routing id, or the sink
an in-process call came with."""


class FrontDoor:
    def __init__(self, config: ServerConfig, tokenizer: Any, supervisor: Children) -> None:
        self.config, self.tokenizer, self.supervisor = config, tokenizer, supervisor
        self.tenants = Tenants.from_config(config)
        self.secret = supervisor.cache_secret
        self.profiles = admin.ProfileDir(config.profile_dir)
        self.ctx = zmq.Context()
        self.rpc, self.rpc_address = bind_rpc(self.ctx, config.rpc_host, config.rpc_port,
                                              config.max_frame_bytes, config.rpc_send_buffer_bytes)
        self.events = TreeEventsOut(config, self.tenants)
        self.encoder = msgspec.msgpack.Encoder()
        self.call_decoder = msgspec.msgpack.Decoder(RpcCall)
        self.sched_decoder = msgspec.msgpack.Decoder(SchedulerOutput)
        self.info: WorkerInfo | None = None
        self.calls: dict[tuple[Peer, int], Call] = {}
        self.rids: RidsInFlight[tuple[Peer, int]] = RidsInFlight()
        """The call each request in flight belongs to, by the request's scoped rid."""
        self.control: ControlCalls[Peer] = ControlCalls()
        self.cache_calls = CacheCalls(tokenizer, config, self.tenants, self.secret)
        self.loras = LoraCalls(config, self.secret)
        self._handlers: dict[type, Callable[[Peer, Any, Who], None]] = {
            GenerateCall: self._on_generate, AbortCall: self._on_abort,
            ModelInfoCall: self._on_model_info,
            WorkersCall: lambda peer, call, who: admin.not_a_router(call, self.rpc_address),
            FlushCacheCall: self._on_scheduler_call, StatsCall: self._on_scheduler_call,
            CacheSnapshotCall: self._on_scheduler_call, ProfileCall: self._on_profile,
            PinCall: self._on_cache_call, UnpinCall: self._on_cache_call,
            CacheInfoCall: self._on_cache_call, LoadLoraCall: self._on_lora_call,
            UnloadLoraCall: self._on_lora_call, LorasCall: self._on_lora_call}
        """How each call is served, by its type (health needs no key: `_on_call`'s)."""
        self.replies = ClientReplies(self.rpc, config.max_client_backlog, self._on_gone,
                                     self._on_slow_reader)
        self.local = InProcessCalls()
        """Calls from this process's HTTP server (its own key is the default tenant's)."""
        self.tokenizing = Tokenizing()
        self.tenants.add_internal_key(self.local.key)
        self.progress = SchedulerProgress(config.scheduler_stall_seconds)
        self._connect_scheduler()

    def _connect_scheduler(self) -> None:
        self.progress.made()  # a new scheduler: starting, not stalled
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(self.supervisor.paths.front_door)
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.LINGER, 0)
        self.outbox.connect(self.supervisor.paths.scheduler)

    @property
    def health(self) -> str:
        return self.progress.health(self.info is not None, self.supervisor.state)

    # -- main loop ----------------------------------------------------------------------
    def serve(self, on_ready: Callable[[str], None], stop_fd: int) -> None:
        """Serve until `stop_fd` turns readable, or the children cannot be kept alive. The
        loop sleeps until a socket, the HTTP thread's pipe, a child's exit (its sentinel) or
        the stop has something to say: only a slow client's backlog is looked at on a timer."""
        poller = zmq.Poller()
        for source in (self.rpc, self.inbox, self.local.fd, self.tokenizing.fd, stop_fd,
                       self.events.replay, self.events.subscriptions.sock):
            if source is not None:
                poller.register(source, zmq.POLLIN)
        sentinels = watch_children(poller, self.supervisor.procs, [])
        announced = False
        while True:
            ready = dict(poller.poll(10 if self.replies.backlog else None))
            if stop_fd in ready:  # a Ctrl-C reaches the children too: that is no crash
                return
            if self.events.subscriptions.sock in ready:  # before this turn's events
                self.events.take_subscriptions()
            if self.rpc in ready:
                self.replies.receive(self.rpc.recv_multipart(copy=False), self.call_decoder,
                                     self._on_call, self.tenants.knows)
            if self.inbox in ready:
                self._on_scheduler(decode(self.sched_decoder, self.inbox.recv()))
            if self.local.fd in ready:
                for call, sink in self.local.take():
                    dispatch(sink, call, self._on_call, self._reply)
            if self.tokenizing.fd in ready:
                self.tokenizing.take()
            if self.events.replay in ready and (dump_to := self.events.serve_replay()):
                self._control(dump_to, 0, CacheSnapshotCall(0, blocks=True), Caller())
            if self.replies.backlog:
                self.replies.flush()
            if self.info is not None and not announced:
                announced = True
                on_ready(self.rpc_address)
            if ready.keys().isdisjoint(sentinels):
                continue
            dead = self.supervisor.check()  # a child exited: the other is stopped too
            if dead:
                self._on_crash(dead, self.supervisor.failure_code)
                if self.supervisor.state == "dead":
                    return
                poller.unregister(self.inbox)
                self.inbox.close(linger=0)
                self.outbox.close(linger=0)
                self._connect_scheduler()
                poller.register(self.inbox, zmq.POLLIN)
            sentinels = watch_children(poller, self.supervisor.procs, sentinels)

    def close(self) -> None:
        self.tokenizing.close()
        self.events.close()
        self.ctx.destroy(linger=0)

    # -- from clients -------------------------------------------------------------------
    def _on_call(self, peer: Peer, call: RpcCall) -> None:
        """Check the caller (its key; the operator's calls need the operator's), then
        dispatch by the call's type (`_handlers`); a ValueError or TypeError a handler
        raises is the caller's `invalid_request`, naming what is wrong."""
        if isinstance(call, HealthCall):
            pids = {"front_door": os.getpid(),
                    **{name: p.pid for name, p in self.supervisor.procs.items()}}
            self._reply(peer, ResultReply(call.call_id, {"status": self.health, "pids": pids}))
            return
        found = self.tenants.who(call.api_key)
        if found is None:
            self._reply(peer, ErrorReply(call.call_id, ErrorCode.UNAUTHORIZED,
                                         "invalid or missing api_key"))
            return
        who = Who(*found)
        handler = self._handlers.get(type(call))
        if isinstance(call, OPERATOR_CALLS) and not who.operator:
            self._reply(peer, ErrorReply(call.call_id, ErrorCode.FORBIDDEN, forbidden_message(
                type(call).__struct_config__.tag)))
        elif self.info is None:
            self._reply(peer, ErrorReply(call.call_id, ErrorCode.NOT_READY,
                                         f"server is {self.health}"))
        elif handler is None:  # a call of the wire schema this server does not serve
            self._reply(peer, ErrorReply(call.call_id, ErrorCode.INVALID_REQUEST,
                                         f"this server does not serve {type(call).__name__}"))
        else:
            self._answer(peer, call.call_id, handler, peer, call, who)

    def _answer(self, peer: Peer, call_id: int, serve: Callable[..., None], *args: Any) -> None:
        """`serve(*args)`; a ValueError or TypeError it raises: the caller's `invalid_request`."""
        try:
            serve(*args)
        except (ValueError, TypeError) as e:
            self._reply(peer, ErrorReply(call_id, ErrorCode.INVALID_REQUEST, str(e)))

    def _on_abort(self, peer: Peer, call: AbortCall, who: Who) -> None:
        scoped = admin.abort_targets(call, who.tenant, who.operator, self.rids)
        self._abort_rids(scoped)
        # A rid's answer is the same either way: it must not tell whether one is in flight.
        self._reply(peer, ResultReply(call.call_id, {"aborted": len(scoped) if call.abort_all
                                                     else call.rid}))

    def _on_model_info(self, peer: Peer, call: ModelInfoCall, who: Who) -> None:
        assert self.info is not None  # `_on_call` answers not_ready while it is None
        self._reply(peer, ResultReply(call.call_id, self.info.model_info(
            self.config.model, self.config.served_model_name) | self.events.addresses))

    def _on_scheduler_call(self, peer: Peer, call: FlushCacheCall | StatsCall
                           | CacheSnapshotCall, who: Who) -> None:
        shape = admin.tenant_stats if isinstance(call, StatsCall) and not who.operator else None
        without_key = msgspec.structs.replace(call, api_key=None)  # it stays at the door
        self._control(peer, call.call_id, without_key, Caller(), shape)

    def _on_profile(self, peer: Peer, call: ProfileCall, who: Who) -> None:
        # A stop names no folder: the worker refuses one.
        output = (admin.profile_output(self.profiles.path(), call.output_dir)
                  if call.action == "start" or call.output_dir is not None else None)
        op = msgspec.structs.replace(call, output_dir=output, api_key=None)
        self._control(peer, call.call_id, op, Caller())

    def _on_cache_call(self, peer: Peer, call: PinCall | UnpinCall | CacheInfoCall,
                       who: Who) -> None:
        assert self.info is not None
        op, caller = self.cache_calls.control(call, who.tenant, who.operator, self.info)
        shape = self.cache_calls.describe if isinstance(call, CacheInfoCall) else None
        self._control(peer, call.call_id, op, caller, shape)

    def _on_lora_call(self, peer: Peer, call: LoraCall, who: Who) -> None:
        op, caller = self.loras.control(call, who.tenant, who.operator)
        self.loras.sent(self._control(peer, call.call_id, op, caller), op)

    def _control(self, peer: Peer, call_id: int, op: ControlOp, caller: Caller,
                 shape: Shape | None = None) -> int:
        """Send `op` to the scheduler under a control id of the front door's, which it
        returns; its answer goes to (peer, call_id), shaped by `shape` (`ControlCalls`)."""
        control_id = self.control.open(peer, call_id, shape)
        self.outbox.send(self.encoder.encode(Control(control_id, op, caller)))
        return control_id

    def _on_generate(self, peer: Peer, call: GenerateCall, who: Who) -> None:
        key = (peer, call.call_id)
        if key in self.calls or key in self.tokenizing.keys:
            raise ValueError(f"call_id {call.call_id} is already in flight")
        namespace = namespace_of(who.tenant, call.cache_salt, self.secret)  # salt: decoded
        assert self.info is not None  # `_on_call` answers not_ready while it is None
        if call.lora_name is not None:  # the whole call, before any request is queued
            self.loras.check(call.lora_name)
        build = functools.partial(build_call, self.tokenizer, self.info, self.config, call,
                                  namespace)
        # Refused here if too large to tokenize at all; large: off this loop (tokenizing.py).
        if check_call_chars(call.text, self.config, self.info) <= INLINE_CHARS:
            self._built(key, call, who, build())
        elif not self.tokenizing.run(who.tenant, key, build, lambda built: self._answer(
                peer, call.call_id, self._built, key, call, who, built)):
            self._reply(peer, ErrorReply(call.call_id, ErrorCode.OVERLOADED, WAITING_FULL))

    def _built(self, key: tuple[Peer, int], call: GenerateCall, who: Who,
               built: tuple[list[TokenizedRequest], bool] | BaseException) -> None:
        """Record a call and send its requests to the scheduler, once tokenized (a large
        call's come back off the loop, or why not: its caller's error, as inline)."""
        if isinstance(built, BaseException):
            raise built  # a ValueError: the caller's (`_answer`); else a bug, as inline
        if self.info is None:  # the scheduler died while the call was tokenized
            self._reply(key[0], ErrorReply(call.call_id, ErrorCode.NOT_READY,
                                           f"server is {self.health}"))
            return
        requests, single = built
        names = [req.rid for req in requests]
        scoped = self.rids.claim(who.tenant, names, key)
        requests = [msgspec.structs.replace(req, rid=rid, tenant=who.tenant)
                    for req, rid in zip(requests, scoped)]
        try:  # before the call is recorded: an in-process caller's ints have no size
            frames = [self.encoder.encode(req) for req in requests]
        except OverflowError as e:
            self.rids.release(scoped, key)
            raise ValueError(f"the call holds an integer outside [-2**63, 2**64 - 1], which "
                             f"no parameter takes ({e})") from None
        self.calls[key] = Call.of(key[0], call, requests, single, names, self.tokenizer)
        for frame in frames:
            self.outbox.send(frame)

    # -- from the scheduler -------------------------------------------------------------
    def _on_scheduler(self, msg: Any) -> None:
        if isinstance(msg, UpdateBatch):
            self.progress.made()
            for update in msg.updates:
                self._on_update(update)
        elif isinstance(msg, RequestRejected):
            key = self.rids.owners.get(msg.rid)
            if key is not None:
                call = self.calls[key]
                self._abort_call(key)
                self._reply(call.peer, ErrorReply(call.call_id, msg.code, msg.message))
        elif isinstance(msg, ControlReply):
            self.loras.answered(msg)
            if (answer := self.control.answer(msg)) is not None:
                self._reply(*answer)
        elif isinstance(msg, CacheEvents):
            if self.events.wanted:  # else nobody subscribes: nothing to re-encode
                self.events.publish(msg)
            self.progress.made()  # a step ended, or the idle loop's heartbeat
        elif isinstance(msg, SchedulerReady):
            self.info = msg.info
            self.loras.ready(msg.info)
            self.supervisor.state = "ok"
            log.info("scheduler and worker ready: %d KV blocks of %d tokens",
                     msg.info.num_blocks, msg.info.page_size)

    def _on_update(self, update: Any) -> None:
        key = self.rids.owners.get(update.rid)
        if key is None:
            return
        call = self.calls[key]
        index = call.outputs.apply(update)
        if index is None:
            return
        state = call.outputs.states[index]
        text = None if call.streamed is None else call.streamed.chunk(
            index, update.new_token_ids, state.text(self.tokenizer) if state.finished else None)
        if text is not None:
            if (text or update.new_token_ids) and not self._reply(
                    call.peer, ChunkReply(call.call_id, index, text, update.new_token_ids)):
                return
            if key not in self.calls:  # that chunk overflowed a slow client's backlog
                return
        if call.outputs.done:
            result = call.outputs.result(self.tokenizer)
            if isinstance(call.peer, bytes):  # a frame carries shared prompt logprobs once
                result = result.packed()
            self._reply(call.peer, ResultReply(call.call_id, result))
            if key in self.calls:  # a reply to a client gone or too slow has forgotten it
                self._forget(key)

    # -- failures -----------------------------------------------------------------------
    def _reply(self, peer: Peer, reply: Any) -> bool:
        """Send to a client (see ClientReplies): False if it is gone (its calls aborted).
        An in-process caller's sink gets the reply object itself; one that takes no more
        (a stream's reader lagged) is gone too."""
        if isinstance(peer, bytes):
            return self.replies.send(peer, reply)
        if peer.put(reply):
            return True
        self._on_gone(peer)
        return False

    def _on_gone(self, peer: Peer) -> None:
        self.tokenizing.cancel(lambda key: key[0] == peer)
        for key in [k for k in self.calls if k[0] == peer]:
            self._abort_call(key)

    def _on_slow_reader(self, peer: Peer) -> dict[int, ErrorReply]:
        """The client's backlog is full: its streams (what fills it) end here, aborted."""
        limit = self.config.max_client_backlog
        errors = {}
        for key in [k for k, c in self.calls.items() if k[0] == peer and c.stream]:
            self._abort_call(key)
            errors[key[1]] = ErrorReply(key[1], ErrorCode.SLOW_READER, (
                f"the stream was ended: the client read its replies too slowly, and more than "
                f"max_client_backlog={limit} (--max-client-backlog) waited for it"))
        return errors

    def _abort_call(self, key: tuple[Peer, int]) -> None:
        outputs = self.calls[key].outputs
        self._abort_rids(dict.fromkeys(s.rid for s in outputs.states if not s.finished))
        self._forget(key)

    def _abort_rids(self, scoped: Iterable[str]) -> None:
        for rid in scoped:
            self.outbox.send(self.encoder.encode(Control(0, AbortCall(0, rid))))

    def _forget(self, key: tuple[Peer, int]) -> None:
        self.rids.release([req.rid for req in self.calls.pop(key).outputs.requests], key)

    def _on_crash(self, message: str, code: ErrorCode = ErrorCode.WORKER_DIED) -> None:
        log.error(message)
        self.info = None
        for key in list(self.calls):
            call = self.calls.get(key)
            if call is None:  # a failed reply just now dropped its client's calls
                continue
            self._forget(key)
            self._reply(call.peer, ErrorReply(call.call_id, code, message))
        for peer, call_id in self.control.drop_all():
            self._reply(peer, ErrorReply(call_id, code, message))
