"""The router's answers for the whole fleet: health, model_info, stats, flush_cache and the
LoRA adapters' load, unload and list fanned out to every routable replica and combined,
and the replicas call (list, add, remove; `WorkersCall`, whose wire name and answer's
`workers` key are SGLang router's).

A part of `Router` (router/core.py), which owns the replicas and the client replies.
"""

from __future__ import annotations

import itertools
import os
from collections import Counter
from functools import partial
from typing import Any, Callable

import msgspec

from radixserve.messages import (AbortCall, ErrorReply, FlushCacheCall, LoadLoraCall,
                                 LorasCall, ModelInfoCall, ResultReply, StatsCall,
                                 UnloadLoraCall, WorkersCall)
from radixserve.results.errors import ErrorCode
from radixserve.router.config import RouterConfig
from radixserve.router.replica import Replica
from radixserve.tenants import Tenants
from radixserve.transport.replies import ClientReplies


class FanOut:
    """The fleet-wide calls of the router (a mixin of `Router`)."""

    # What it uses of `Router` (and of its other part, `Fleet`), which set and define them.
    config: RouterConfig
    tenants: Tenants
    replies: ClientReplies
    replicas: dict[str, Replica]
    ids: itertools.count[int]
    replica_key: str | None
    replica_admin_key: str | None
    reasons: Counter[str]
    busy_seconds: dict[str, float]
    add_replica: Callable[[str], Replica]
    remove_replica: Callable[[str], None]
    _control: Callable[[Replica, Any, Callable[[Any], None]], None]
    _forwarded: Callable[[str | None], tuple[str | None, str]]
    _error: Callable[[bytes, int, ErrorCode, str], None]
    _no_replica: Callable[[bytes, int], None]

    def _on_model_info(self, peer: bytes, call: ModelInfoCall) -> None:
        info = next((r.info for r in self.replicas.values() if r.routable), None)
        if info is None:
            self._no_replica(peer, call.call_id)
        else:
            self.replies.send(peer, ResultReply(call.call_id, {
                **info, "router": {"policy": self.config.policy,
                                   "replicas": len(self.replicas)}}))

    def _on_stats(self, peer: bytes, call: StatsCall) -> None:
        self._fan_out(peer, call.call_id, lambda: StatsCall(next(self.ids), self.replica_key),
                      self._combine_stats)

    def _on_flush(self, peer: bytes, call: FlushCacheCall) -> None:
        self._fan_out(peer, call.call_id,
                      lambda: FlushCacheCall(next(self.ids), self.replica_admin_key),
                      lambda results: {"flushed": all(r.get("flushed") for r in
                                                      results.values())})

    def _on_abort_all(self, peer: bytes, call: AbortCall) -> None:
        """Passed to every replica: a tenant's as its caller (it reaches that tenant's
        requests there), the operator's with the replicas' operator key (every tenant's, or
        `tenant`'s); a tenant naming a tenant is refused by the replicas."""
        operator = self.tenants.is_operator(call.api_key)
        key = self.replica_admin_key if operator else self._forwarded(call.api_key)[0]
        self._fan_out(peer, call.call_id, lambda: AbortCall(
            next(self.ids), call.rid, key, call.abort_all, call.tenant),
            lambda results: {"aborted": sum(r["aborted"] for r in results.values())
                             if call.abort_all else call.rid})

    def _on_lora(self, peer: bytes, call: LoadLoraCall | UnloadLoraCall | LorasCall) -> None:
        """An adapter is loaded on (unloaded from) every replica, with the replicas'
        operator key (the router checked the caller's); the answer is the first replica's
        (an error if any refused: the others keep what they did, and a retry after an
        unload makes the fleet alike again). A replica added later has only its own
        `--lora-paths`. The list is the adapters on every replica (a caller's own key
        decides whether paths are shown)."""
        if isinstance(call, LorasCall):
            key = (self.replica_admin_key if self.tenants.is_operator(call.api_key)
                   else self._forwarded(call.api_key)[0])
            self._fan_out(peer, call.call_id, lambda: LorasCall(next(self.ids), key),
                          _common_loras)
            return
        self._fan_out(peer, call.call_id, lambda: msgspec.structs.replace(
            call, call_id=next(self.ids), api_key=self.replica_admin_key),
            lambda results: next(iter(results.values())))

    def _on_replicas(self, peer: bytes, call: WorkersCall) -> None:
        """List, add or remove a replica; the answer keeps SGLang router's key `workers`."""
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
            self._error(peer, call.call_id, ErrorCode.INVALID_REQUEST, str(e))
            return
        done = "added" if call.action == "add" else "removed"
        self.replies.send(peer, ResultReply(call.call_id, {done: call.url}))

    def _health(self) -> dict[str, Any]:
        ok = any(r.routable for r in self.replicas.values())
        return {"status": "ok" if ok else "no_replica", "pids": {"router": os.getpid()},
                "replicas": {r.url: r.state for r in self.replicas.values()}}


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
            self._control(replica, make(), partial(one, replica))

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



def _common_loras(results: dict[str, Any]) -> dict[str, Any]:
    """The adapters every replica has loaded (in the first replica's order)."""
    named = [{a["name"] for a in r["loras"]} for r in results.values()]
    first = next(iter(results.values()))["loras"]
    return {"loras": [a for a in first if all(a["name"] in n for n in named)]}
