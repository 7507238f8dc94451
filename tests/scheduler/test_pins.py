"""Pinned prefixes in the scheduler (fake worker): a pin prefills what is not cached,
survives a flood that evicts everything else and a flush, lapses at its ttl, is bounded by
max_pinned_tokens, and lives in its own namespace; the cache view lists it."""

from __future__ import annotations

import time

from radixserve.messages import (CacheScope, Caller, Control, ControlReply, PinCall,
                                 SamplingParams, TokenizedRequest, UnpinCall)
from radixserve.scheduler.scheduler import Scheduler
from tests.scheduler.fake_worker import FakeWorker, fake_scheduler

VOCAB, PAGE = 32, 4


def new_scheduler(num_blocks: int = 32, **config: object) -> tuple[Scheduler, FakeWorker]:
    return fake_scheduler(num_blocks, PAGE, VOCAB, 64, **config)


def prompt(seed: int, n: int = 33) -> list[int]:
    return [(seed * 11 + 7 * i) % (VOCAB - 2) + 2 for i in range(n)]


def drain(sched: Scheduler, worker: FakeWorker) -> dict[str, int]:
    """Run until idle; each finished rid's cached_tokens."""
    cached = {}
    while sched.has_work:
        batch, updates = sched.schedule()
        if batch is not None:
            updates += sched.process_result(batch, worker.forward(batch.forward))
        cached.update((u.rid, u.cached_tokens) for u in updates if u.finished)
    sched.check_invariants()
    return cached


def generate(sched: Scheduler, worker: FakeWorker, rid: str, ids: list[int],
             namespace: str | None = None) -> int:
    sched.add_request(TokenizedRequest(rid=rid, input_ids=ids, namespace=namespace, sampling=(
        SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True))))
    return drain(sched, worker)[rid]


def pin(sched: Scheduler, worker: FakeWorker, ids: list[int], ttl: float | None = None,
        namespace: str | None = None, call_id: int = 1) -> ControlReply:
    request = TokenizedRequest(rid=f"pin-{call_id}", input_ids=ids, namespace=namespace,
                               sampling=SamplingParams(max_new_tokens=0))
    reply = sched.pin(Control(call_id, PinCall(call_id=call_id, input_ids=ids, ttl=ttl),
                              Caller(namespace=namespace)), request)
    if reply is None:
        assert drain(sched, worker) == {}, "a pin's prefill reports to nobody"
        (reply,) = sched.outbox
        sched.outbox.clear()
        assert isinstance(reply, ControlReply)
    assert reply.call_id == call_id
    return reply


def unpin(sched: Scheduler, ids: list[int], namespace: str | None = None) -> dict:
    return sched.cache.unpin(UnpinCall(call_id=9, input_ids=ids), Caller(namespace=namespace))


def assert_idle_accounted(sched: Scheduler) -> None:
    sched.check_invariants()
    assert sched.cache.radix_cache.locked_blocks == 0
    assert sched.flush_cache()
    assert sched.cache.allocator.num_free == sched.cache.allocator.num_blocks


class TestPin:
    def test_pinned_prefix_survives_a_flood_and_a_flush(self) -> None:
        sched, worker = new_scheduler()
        system = prompt(1)
        reply = pin(sched, worker, system)  # not cached: prefilled first
        assert reply.error is None and reply.payload["tokens"] == 32, reply
        assert sched.cache.radix_cache.pinned_tokens == 32
        for i in range(12):  # each needs 9 of the 32 blocks: everything unpinned goes
            generate(sched, worker, f"flood{i}", prompt(100 + i))
        assert sched.cache.radix_cache.evicted_tokens > 0
        assert generate(sched, worker, "again", system + [5, 6]) == 32
        assert sched.flush_cache()
        assert sched.cache.radix_cache.cached_tokens == 32  # a flush keeps the pinned prefix
        assert unpin(sched, system)["unpinned"]
        assert not unpin(sched, system)["unpinned"]
        assert_idle_accounted(sched)

    def test_cached_prefix_pins_at_once_and_pin_again_refreshes(self) -> None:
        sched, worker = new_scheduler()
        system = prompt(2)
        generate(sched, worker, "warm", system)
        request = TokenizedRequest(rid="p", input_ids=system, sampling=SamplingParams(
            max_new_tokens=0))
        reply = sched.pin(Control(1, PinCall(call_id=1, input_ids=system)), request)
        assert reply is not None and reply.error is None
        assert pin(sched, worker, system, ttl=100).payload["expires_in"] > 99
        assert sched.cache.radix_cache.pinned_tokens == 32 and len(sched.cache.pins.pins) == 1
        unpin(sched, system)
        assert_idle_accounted(sched)

    def test_ttl_expiry_releases_the_pin(self) -> None:
        sched, worker = new_scheduler()
        pin(sched, worker, prompt(3), ttl=0.05)
        assert sched.cache.radix_cache.pinned_tokens == 32
        time.sleep(0.06)
        sched.schedule()
        assert sched.cache.radix_cache.pinned_tokens == 0 and not sched.cache.pins.pins
        assert_idle_accounted(sched)

    def test_bound_refuses_naming_the_flag(self) -> None:
        sched, worker = new_scheduler(max_pinned_tokens=40)
        assert pin(sched, worker, prompt(4)).error is None
        reply = pin(sched, worker, prompt(5), call_id=2)
        assert reply.error is not None and "--max-pinned-tokens" in reply.error, reply
        too_big = pin(sched, worker, prompt(6, 60), call_id=3)
        assert "max_pinned_tokens=40" in too_big.error
        assert sched.cache.radix_cache.pinned_tokens == 32
        unpin(sched, prompt(4))
        assert_idle_accounted(sched)

    def test_less_than_a_page_is_refused(self) -> None:
        sched, worker = new_scheduler()
        assert "page_size" in pin(sched, worker, [3, 4]).error

    def test_namespaces_have_separate_pins(self) -> None:
        sched, worker = new_scheduler()
        system = prompt(7)
        pin(sched, worker, system, namespace="ns-a")
        assert not unpin(sched, system, namespace="ns-b")["unpinned"]
        assert not unpin(sched, system)["unpinned"]
        assert generate(sched, worker, "b", system + [9], namespace="ns-b") == 0
        info = sched.cache.cache_info(20, CacheScope("ns-b", False))
        assert info["pins"] == [] and all(n["namespace"] == "ns-b" for n in info["nodes"])
        pin(sched, worker, prompt(8), namespace="ns-b", call_id=2)
        dropped = sched.cache.unpin(UnpinCall(call_id=3, all=True),
                              Caller(scope=CacheScope("ns-a", False)))
        assert dropped == {"unpinned": True, "pins": 1, "tokens": 32, "pinned_tokens": 32}
        assert list(sched.cache.pins.pins) == [("ns-b", tuple(prompt(8)[:32]))]
        # every namespace
        assert sched.cache.unpin(UnpinCall(call_id=4, all=True), Caller())["pins"] == 1
        assert_idle_accounted(sched)


class TestCacheInfo:
    def test_lists_prefixes_with_hits_and_pins(self) -> None:
        sched, worker = new_scheduler()
        system = prompt(8)
        for i in range(3):
            generate(sched, worker, f"q{i}", system + [i + 2] * 4)
        pin(sched, worker, system)
        info = sched.cache.cache_info(5)
        nodes = {n["id"]: n for n in info["nodes"]}
        root = next(n for n in nodes.values() if n["parent"] is None)
        assert root["head_ids"] == system[:24] and root["hits"] == 2 and root["pinned"]
        assert root["tier"] == "memory" and root["prefix_tokens"] == 32
        assert all(nodes[n["parent"]]["depth"] == n["depth"] - 1
                   for n in nodes.values() if n["parent"] is not None)
        assert info["totals"]["memory"]["pinned_tokens"] == 32
        assert info["totals"]["disk"]["tokens"] == 0
        assert info["pins"][0]["tokens"] == 32 and info["pins"][0]["expires_in"] is None
        unpin(sched, system)
        assert_idle_accounted(sched)
