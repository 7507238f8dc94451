"""The scheduler's CacheEvents (what a replica publishes for a cache-aware router): one after
each step that changed the tree or the load, none when nothing did, seq 1, 2, ... in an
epoch of its own; the load's numbers; snapshots through EngineCore.handle."""

from __future__ import annotations

import msgspec

from radixserve.cache.events import page_hashes
from radixserve.config import EngineConfig
from radixserve.messages import (CacheEvents, CacheSnapshotCall, Control, ControlReply,
                                 FlushCacheCall, ReplicaLoad, SamplingParams,
                                 TokenizedRequest, WorkerInfo)
from radixserve.scheduler.core import EngineCore
from radixserve.scheduler.scheduler import Scheduler
from tests.scheduler.fake_worker import FakeWorker

VOCAB, PAGE = 32, 4
PROMPT = [(5 * i + 1) % (VOCAB - 2) + 2 for i in range(22)]  # 5 pages and 2 tokens


def new_core(num_blocks: int = 64, chunk: int = 64, cache: bool = True) -> EngineCore:
    config = EngineConfig(page_size=PAGE, max_total_tokens=num_blocks * PAGE, seed=0,
                          chunked_prefill_size=chunk, debug_invariants=True,
                          enable_prefix_cache=cache)
    info = WorkerInfo(model_path="fake", num_blocks=num_blocks, page_size=PAGE,
                      context_length=1024, vocab_size=VOCAB, eos_token_ids=[0],
                      device="cpu", dtype="float32", kv_pool_bytes=0)
    sched = Scheduler(config, info, cache_events=True)
    return EngineCore(sched, FakeWorker(num_blocks, PAGE, VOCAB), info)


def request(rid: str, prompt: list[int], max_new: int = 3, n: int = 1) -> TokenizedRequest:
    return TokenizedRequest(rid=rid, input_ids=prompt, sampling=SamplingParams(
        max_new_tokens=max_new, temperature=0, ignore_eos=True, n=n))


class Replica:
    """An EngineCore driven the way the scheduler process drives it, and a subscriber's
    view kept from the CacheEvents it makes."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.events: list[CacheEvents] = []
        self.view: set[int] = set()

    def take(self) -> CacheEvents | None:
        events = self.core.take_cache_events()
        if events is not None:
            self.events.append(events)
            if events.cleared:
                self.view.clear()
            self.view.difference_update(events.removed)
            self.view.update(events.stored)
        return events

    def run(self) -> None:
        while self.core.has_work:
            self.core.step()
            self.take()

    @property
    def tree(self) -> set[int]:
        return set(self.core.scheduler.cache.radix_cache.page_hashes_in_tree())


class TestEvents:
    def test_a_request_publishes_its_pages_and_nothing_after(self) -> None:
        r = Replica(new_core())
        r.core.submit(request("a", PROMPT))
        r.run()
        assert [e.seq for e in r.events] == list(range(1, len(r.events) + 1))
        assert len({e.epoch for e in r.events}) == 1
        stored = [h for e in r.events for h in e.stored]
        assert set(page_hashes(PROMPT, PAGE)) <= set(stored)
        assert r.view == r.tree and len(r.view) == (len(PROMPT) + 3 - 1) // PAGE
        assert r.events[-1].load == ReplicaLoad()  # idle again
        assert r.take() is None  # nothing changed since: no event
        beat = r.core.take_cache_events(heartbeat=True)
        assert beat is not None and beat.seq == r.events[-1].seq + 1
        assert (beat.stored, beat.removed, beat.cleared) == ([], [], False)

    def test_eviction_and_flush_reach_the_view(self) -> None:
        r = Replica(new_core(num_blocks=12))  # room for about one request's pages
        other = [t ^ 1 for t in PROMPT]
        for i, prompt in enumerate([PROMPT, other, PROMPT]):
            r.core.submit(request(f"r{i}", prompt))
            r.run()
            assert r.view == r.tree
        assert any(e.removed for e in r.events)
        r.core.handle(Control(1, FlushCacheCall(1)))
        events = r.take()
        assert events is not None and events.cleared and not events.stored
        assert r.view == r.tree == set()

    def test_a_disabled_cache_reports_load_only(self) -> None:
        r = Replica(new_core(cache=False))
        r.core.submit(request("a", PROMPT))
        r.run()
        assert r.events and all(not e.stored and not e.removed for e in r.events)
        assert any(e.load.running_requests for e in r.events)

    def test_each_scheduler_has_its_own_epoch(self) -> None:
        """Even with the same seed: a restarted replica's tree is new."""
        a, b = new_core(), new_core()
        assert a.epoch != b.epoch


class TestLoad:
    def test_queued_then_running_then_idle(self) -> None:
        core = new_core(chunk=8)  # the prompt takes three steps
        sched = core.scheduler
        core.submit(request("a", PROMPT, max_new=4, n=2))
        assert core.load() == ReplicaLoad(waiting_requests=2, waiting_tokens=len(PROMPT))
        core.step()
        assert core.load() == ReplicaLoad(running_requests=1, running_tokens=8)
        while core.load().running_requests < 2:  # the prompt is in, the sample forked
            core.step()
        load = core.load()
        assert load.waiting_requests == 0 and load.waiting_tokens == 0
        assert load.running_tokens == sum(q.kv.kv_len for q in sched.running)
        assert len(PROMPT) * 2 <= load.running_tokens <= (len(PROMPT) + 4) * 2
        while core.has_work:
            core.step()
        assert core.load() == ReplicaLoad()

    def test_each_load_change_is_one_event(self) -> None:
        r = Replica(new_core(chunk=8))
        r.take()  # the first one names the epoch
        r.core.submit(request("a", PROMPT))
        assert r.take().load.waiting_requests == 1  # queued, before any step
        loads = []
        while r.core.has_work:
            r.core.step()
            loads.append(r.take().load)  # every step moves running_tokens on
        assert loads[-1] == ReplicaLoad() and r.take() is None


class TestSnapshot:
    def test_snapshot_through_handle(self) -> None:
        r = Replica(new_core())
        r.core.submit(request("a", PROMPT))
        r.run()
        reply = r.core.handle(Control(7, CacheSnapshotCall(7)))
        assert isinstance(reply, ControlReply) and reply.call_id == 7 and reply.error is None
        snap = msgspec.msgpack.decode(msgspec.msgpack.encode(reply.payload))  # as on the wire
        assert snap["epoch"] == r.events[-1].epoch and snap["seq"] == r.events[-1].seq
        assert snap["page_size"] == PAGE and set(snap["hashes"]) == r.tree
        assert msgspec.convert(snap["load"], ReplicaLoad) == ReplicaLoad()

    def test_a_snapshot_between_events_plus_the_later_events_is_the_tree(self) -> None:
        """Taken mid-run, the snapshot holds changes not yet sent: the events with a larger
        seq must still bring a view that starts from it to the tree."""
        r = Replica(new_core(num_blocks=12, chunk=8))
        other = [t ^ 1 for t in PROMPT]
        r.core.submit(request("a", PROMPT))
        r.core.submit(request("b", other))
        for _ in range(4):
            r.core.step()
            r.take()
        r.core.step()  # its events not taken yet
        snap = r.core.cache_snapshot()
        view = set(snap["hashes"])
        assert view - r.view  # it holds a page that no event has named yet
        r.run()
        r.core.submit(request("c", PROMPT[:9] + other[9:]))
        r.run()
        for events in r.events:
            if events.seq > snap["seq"]:
                if events.cleared:
                    view.clear()
                view.difference_update(events.removed)
                view.update(events.stored)
        assert any(e.removed for e in r.events if e.seq > snap["seq"])
        assert view == r.view == r.tree
