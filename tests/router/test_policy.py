"""The routing policies on made-up fleets: where a call goes and why."""

from __future__ import annotations

from radixserve.router.config import RouterConfig
from radixserve.router.policy import Candidate, CacheAware, RoundRobin, ShortestQueue


def cand(name: str, matched: int = 0, requests: int = 0, tokens: int = 0) -> Candidate:
    return Candidate(name, matched, requests, tokens, cached_pages=0)


def cache_aware(**options) -> CacheAware:
    return CacheAware(RouterConfig(**options))


class TestCacheAware:
    def test_a_hit_above_the_threshold_wins_over_load(self):
        choice = cache_aware().choose([cand("a", matched=400, requests=5, tokens=4000),
                                       cand("b", tokens=10)], prompt_tokens=500)
        assert (choice.name, choice.reason) == ("a", "cache_hit")

    def test_a_miss_goes_to_the_least_loaded(self):
        choice = cache_aware().choose([cand("a", matched=100, tokens=900),
                                       cand("b", tokens=300), cand("c", tokens=500)],
                                      prompt_tokens=1000)
        assert (choice.name, choice.reason) == ("b", "cache_miss")

    def test_imbalance_sets_the_overloaded_aside_and_keeps_affinity_among_the_rest(self):
        policy = cache_aware(balance_abs_threshold=4, balance_rel_threshold=1.5)
        fleet = [cand("hot", matched=500, requests=20), cand("warm", matched=200, requests=2),
                 cand("cold", requests=1)]
        choice = policy.choose(fleet, prompt_tokens=500)
        assert (choice.name, choice.reason) == ("warm", "rebalance")
        # Below both thresholds the hit stays where it is.
        balanced = [cand("hot", matched=500, requests=5), cand("cold", requests=2)]
        assert policy.choose(balanced, prompt_tokens=500).name == "hot"

    def test_both_thresholds_must_be_crossed(self):
        policy = cache_aware(balance_abs_threshold=4, balance_rel_threshold=1.5)
        # 10 above, but only 1.2x: not imbalanced.
        fleet = [cand("a", matched=500, requests=60), cand("b", requests=50)]
        assert policy.choose(fleet, prompt_tokens=500).name == "a"


def test_round_robin_cycles_in_name_order():
    policy = RoundRobin(RouterConfig())
    fleet = [cand("b"), cand("a"), cand("c")]
    assert [policy.choose(fleet, 10).name for _ in range(4)] == ["a", "b", "c", "a"]


def test_shortest_queue_counts_requests():
    fleet = [cand("a", requests=3, tokens=10), cand("b", requests=1, tokens=9000)]
    assert ShortestQueue(RouterConfig()).choose(fleet, 10).name == "b"
