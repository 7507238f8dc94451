"""Which replica a call goes to: the four policies of `--policy`.

Each gets the healthy replicas as `Candidate`s (what each holds of the call's prompt and how
busy it is) and returns one. Load is counted two ways, as SGLang's router does: in requests
to tell whether the replicas are imbalanced (its thresholds are request counts), and in
tokens (queued + running) to pick the least loaded one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol, Sequence

from radixserve.router.config import RouterConfig


@dataclass(frozen=True)
class Candidate:
    name: str
    matched_tokens: int
    """Leading prompt tokens this replica holds (or is about to: see view.py)."""
    requests: int
    """Queued + running requests."""
    tokens: int
    """Queued prompt tokens + running requests' context tokens."""
    cached_pages: int


@dataclass(frozen=True)
class Choice:
    name: str
    reason: str
    """cache_hit, cache_miss, rebalance, round_robin, random or shortest_queue."""


class Policy(Protocol):
    def choose(self, candidates: Sequence[Candidate], prompt_tokens: int) -> Choice: ...


def least_loaded(candidates: Sequence[Candidate]) -> Candidate:
    """Fewest tokens, then fewest requests; among equals, the one caching least (most room
    for a new prefix), then by name, so that runs repeat."""
    return min(candidates, key=lambda c: (c.tokens, c.requests, c.cached_pages, c.name))


class CacheAware:
    """The longest cached prefix wins when it covers `cache_threshold` of the prompt and
    the load is balanced; a miss goes to the least loaded replica. When the load is
    imbalanced (the busiest replica has more than `balance_abs_threshold` requests above
    the idlest, and more than `balance_rel_threshold` times its count), the overloaded
    replicas are set aside and the best match among the rest wins: the hot prefix spreads
    to a second replica while the other prefixes stay where they are cached."""

    def __init__(self, config: RouterConfig) -> None:
        self.threshold = config.cache_threshold
        self.abs, self.rel = config.balance_abs_threshold, config.balance_rel_threshold

    def choose(self, candidates: Sequence[Candidate], prompt_tokens: int) -> Choice:
        low = min(c.requests for c in candidates)
        high = max(c.requests for c in candidates)
        reason = "cache_hit"
        if high - low > self.abs and high > self.rel * low:
            candidates = [c for c in candidates
                          if not (c.requests - low > self.abs and c.requests > self.rel * low)]
            reason = "rebalance"
        best = max(candidates, key=lambda c: (c.matched_tokens, -c.tokens, -c.requests))
        if prompt_tokens and best.matched_tokens >= self.threshold * prompt_tokens \
                and best.matched_tokens > 0:
            return Choice(best.name, reason)
        return Choice(least_loaded(candidates).name,
                      "rebalance" if reason == "rebalance" else "cache_miss")


class RoundRobin:
    def __init__(self, config: RouterConfig) -> None:
        self.turn = 0

    def choose(self, candidates: Sequence[Candidate], prompt_tokens: int) -> Choice:
        ordered = sorted(candidates, key=lambda c: c.name)
        self.turn += 1
        return Choice(ordered[(self.turn - 1) % len(ordered)].name, "round_robin")


class Random:
    def __init__(self, config: RouterConfig, seed: int | None = None) -> None:
        self.rng = random.Random(seed)

    def choose(self, candidates: Sequence[Candidate], prompt_tokens: int) -> Choice:
        return Choice(self.rng.choice(sorted(c.name for c in candidates)), "random")


class ShortestQueue:
    def __init__(self, config: RouterConfig) -> None:
        pass

    def choose(self, candidates: Sequence[Candidate], prompt_tokens: int) -> Choice:
        best = min(candidates, key=lambda c: (c.requests, c.tokens, c.name))
        return Choice(best.name, "shortest_queue")


POLICY_CLASSES: dict[str, type] = {"cache_aware": CacheAware, "round_robin": RoundRobin,
                                   "random": Random, "shortest_queue": ShortestQueue}


def make_policy(config: RouterConfig) -> Policy:
    return POLICY_CLASSES[config.policy](config)
