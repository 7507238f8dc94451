"""`RadixTreeRouter`: a Ray Serve request router (`ray.serve.request_router.RequestRouter`)
that sends each call to the replica whose radix tree holds the longest prefix of its
prompt, as radixserve's own router does: the same exact views (page hashes keyed by the
shared cache secret, fed by each replica's cache events: feed.py) and the same policy
(router/policy.py `CacheAware`: a match covering `cache_threshold` of the prompt wins
unless the load is imbalanced; else the least loaded replica).

Ray pickles this module by value into every process that routes (its globals are copies
there, and so are the objects its functions name): what must be shared with the ingress
(`feed.ROUTERS`) is reached through its module.

It runs where the calls are made: in the ingress replicas' processes, on the deployment
handle to the radixserve replicas. The call's first argument is its `RouteKey` (keys.py).
Ray then takes the first replica of the ranks returned here that has room
(`max_ongoing_requests`): a full replica gives way to the next, the guard against one hot
replica that Ray itself enforces."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

import logging

from radixserve.cache.events import page_hashes
from radixserve.ray import feed
from radixserve.ray.feed import TreeFeed
from radixserve.ray.keys import RouteKey, fleet_secret
from radixserve.router.config import RouterConfig
from radixserve.router.policy import POLICY_CLASSES, Candidate, Policy

log = logging.getLogger("ray.serve")

MAX_CHOSEN = 4096
"""Calls chosen for and not yet routed that the router remembers (their keys)."""



class RadixTreeRouter(RequestRouter):  # type: ignore[misc]
    def initialize_state(self, cache_secret: str | None = None,
                         cache_secret_file: str | None = None, operator_key: str | None = None,
                         policy: str = "cache_aware", cache_threshold: float = 0.3,
                         balance_abs_threshold: int = 64, balance_rel_threshold: float = 1.5,
                         **_: Any) -> None:
        """`request_router_kwargs`: the replicas' cache secret (what their secret file
        holds) or that file (on every node), the operator key their cache events take, and
        radixserve's router policy options."""
        self.secret = fleet_secret(cache_secret, cache_secret_file)
        self.feed = TreeFeed(operator_key)
        config = RouterConfig(policy=policy,  # type: ignore[arg-type]
                              cache_threshold=cache_threshold,
                              balance_abs_threshold=balance_abs_threshold,
                              balance_rel_threshold=balance_rel_threshold)
        self.policy: Policy = POLICY_CLASSES[policy](config)
        self.requests: Counter[str] = Counter()
        self.tokens: Counter[str] = Counter()
        self.routes: dict[str, tuple[RouteKey, dict[int, list[int]]]] = {}
        """Each call's key and its page hashes by page size, from choosing to routing."""
        self.held: dict[str, tuple[str, int, list[int]]] = {}
        """Calls in flight: (replica, tokens, the page hashes held in its view)."""
        self.reasons: Counter[str] = Counter()
        feed.ROUTERS.add(self)  # a module: shared, never pickled by value

    def describe(self) -> dict[str, Any]:
        """Each replica's view as this router holds it, and why it routed as it did."""
        with self.feed.lock:
            trees = {name: {"synced": t.view.synced, "cached_pages": len(t.view.hashes),
                            "provisional_pages": len(t.view.provisional),
                            "requests": self.requests[name], "tokens": self.tokens[name],
                            "events_address": t.events_address}
                     for name, t in self.feed.trees.items()}
        return {"replicas": trees, "reasons": dict(self.reasons)}

    def _candidates(self, replicas: list[RunningReplica], key: RouteKey,
                    hashes: dict[int, list[int]]) -> list[Candidate]:
        out = []
        with self.feed.lock:
            for r in replicas:
                name = r.replica_id.unique_id
                tree = self.feed.ensure(name, r.replica_metadata)
                matched = 0
                if tree is not None and key.prompts:
                    page = tree.page_size
                    if page not in hashes:
                        hashes[page] = [h for p in key.prompts
                                        for h in page_hashes(p, page, key.namespace,
                                                             key=self.secret)]
                    matched = self._matched(tree, key, page)
                queued = self.replica_queue_len_cache.get(r.replica_id) or 0
                out.append(Candidate(name, matched, max(self.requests[name], queued),
                                     self.tokens[name],
                                     len(tree.view.hashes) if tree is not None else 0))
        return out

    def _matched(self, tree: Any, key: RouteKey, page: int) -> int:
        total = 0
        for p in key.prompts:
            total += tree.view.matched_pages(
                page_hashes(p, page, key.namespace, key=self.secret)) * page
        return total

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = RouteKey()
        if pending_request is not None and pending_request.args and isinstance(
                pending_request.args[0], RouteKey):
            key = pending_request.args[0]
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        if key.replica in by_name:
            return [[by_name[key.replica]]]
        hashes: dict[int, list[int]] = {}
        candidates = self._candidates(candidate_replicas, key, hashes)
        choice = self.policy.choose(candidates, key.tokens)
        log.debug("%s: %s", choice, candidates)
        self.reasons[choice.reason] += 1
        if pending_request is not None:
            self.routes[pending_request.metadata.internal_request_id] = (key, hashes)
            while len(self.routes) > MAX_CHOSEN:  # calls cancelled before Ray routed them
                self.routes.pop(next(iter(self.routes)))
        load = {c.name: (c.tokens, c.requests, c.name) for c in candidates}
        rest = sorted((r for n, r in by_name.items() if n != choice.name),
                      key=lambda r: load[r.replica_id.unique_id])
        return [[by_name[choice.name]], rest] if rest else [[by_name[choice.name]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any,
                          result: Any) -> None:
        request_id = pending_request.metadata.internal_request_id
        key, hashes = self.routes.pop(request_id, (RouteKey(), {}))
        name = replica_id.unique_id
        tree = self.feed.trees.get(name)
        held: list[int] = []
        if tree is not None and key.prompts:
            held = hashes.get(tree.page_size) or [
                h for p in key.prompts
                for h in page_hashes(p, tree.page_size, key.namespace, key=self.secret)]
            with self.feed.lock:
                tree.view.hold(held)
        self.requests[name] += 1
        self.tokens[name] += key.tokens
        self.held[request_id] = (name, key.tokens, held)

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        self.routes.pop(internal_request_id, None)
        entry = self.held.pop(internal_request_id, None)
        if entry is None:
            return
        name, tokens, held = entry
        self.requests[name] -= 1
        self.tokens[name] -= tokens
        tree = self.feed.trees.get(name)
        if tree is not None:
            with self.feed.lock:
                tree.view.release(held, time.monotonic())

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self.feed.forget({replica_id.unique_id})
        with self.feed.lock:
            self.requests.pop(replica_id.unique_id, None)
            self.tokens.pop(replica_id.unique_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        for r in replicas:  # subscribed before their first call
            self.feed.ensure(r.replica_id.unique_id, r.replica_metadata)
        live = {r.replica_id.unique_id for r in replicas}
        self.feed.forget(set(self.feed.trees) - live)
