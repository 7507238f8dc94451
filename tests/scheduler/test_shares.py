"""Fair shares between tenants in the scheduler (issue 41, finding 5): a tenant's queue is
bounded on its own, tenants are admitted in turn rather than first come first served, a
tenant keeps to its share of the batch while another waits, and one that filled the batch
first gives places back; a tenant alone keeps the whole server."""

from __future__ import annotations

import msgspec
import pytest

from radixserve.config import EngineConfig
from radixserve.messages import LoraInfo, SamplingParams, TokenizedRequest, WorkerInfo
from radixserve.scheduler.scheduler import OverloadedError, Scheduler
from tests.scheduler.fake_worker import FakeWorker, fake_scheduler

VOCAB, PAGE, BLOCKS = 32, 4, 1024


def new_scheduler(**options: object) -> tuple[Scheduler, FakeWorker]:
    return fake_scheduler(BLOCKS, PAGE, VOCAB, 256, **options)


def request(tenant: str, i: int, new_tokens: int = 4, n: int = 1) -> TokenizedRequest:
    return TokenizedRequest(
        rid=f"{tenant}/{i}", tenant=tenant, input_ids=[2 + i % 20, 3, 4, 5, 6],
        sampling=SamplingParams(max_new_tokens=new_tokens, n=n, temperature=0,
                                ignore_eos=True))


def step(sched: Scheduler, worker: FakeWorker) -> list[str]:
    """One step; the rids that finished in it."""
    batch, updates = sched.schedule()
    if batch is not None:
        updates += sched.process_result(batch, worker.forward(batch.forward))
    return [u.rid for u in updates if u.finished]


def running(sched: Scheduler, tenant: str) -> int:
    return sum(1 for r in sched.running if r.group.tenant == tenant)


def drain(sched: Scheduler, worker: FakeWorker) -> list[str]:
    finished = []
    for _ in range(2000):  # a request that could never be admitted fails, not hangs
        if not sched.has_work:
            break
        finished += step(sched, worker)
    assert not sched.has_work, "a request was never admitted"
    sched.check_invariants()
    assert sched.flush_cache()
    assert sched.cache.allocator.num_free == sched.cache.allocator.num_blocks
    return finished


def test_a_tenant_past_its_queue_share_is_refused_naming_it_and_others_still_queue() -> None:
    sched, worker = new_scheduler(max_queued_requests=64, max_queued_requests_per_tenant=16)
    for i in range(16):
        sched.add_request(request("bob", i))
    with pytest.raises(OverloadedError, match="max_queued_requests_per_tenant=16"):
        sched.add_request(request("bob", 16))
    with pytest.raises(OverloadedError, match="max_queued_requests_per_tenant=16"):
        sched.add_request(request("bob", 17, n=2))  # samples count as outputs
    sched.add_request(request("alice", 0))  # the other tenant's room is untouched
    assert len(drain(sched, worker)) == 17


def test_tenants_are_admitted_in_turn_not_first_come_first_served() -> None:
    """Bob queued 40 requests before alice's 2; with room for 4 per step alice's both run
    in the first batches, not after bob's 40."""
    sched, worker = new_scheduler(max_running_requests=4, schedule_policy="fcfs")
    for i in range(40):
        sched.add_request(request("bob", i))
    for i in range(2):
        sched.add_request(request("alice", i))
    step(sched, worker)
    assert running(sched, "alice") == 2 and running(sched, "bob") == 2
    finished = drain(sched, worker)
    assert finished.index("alice/1") < 8, finished[:10]


def test_a_tenant_that_filled_the_batch_gives_places_back_to_a_newcomer() -> None:
    """Bob's long requests fill every place; alice's request, arriving later, gets half
    the batch within a few steps (bob's newest are retracted, their prefixes cached) and
    ends long before bob's, which all still finish."""
    sched, worker = new_scheduler(max_running_requests=8)
    for i in range(8):
        sched.add_request(request("bob", i, new_tokens=200))
    for _ in range(3):
        step(sched, worker)
    assert running(sched, "bob") == 8
    for i in range(4):
        sched.add_request(request("alice", i))
    finished: list[str] = []
    for _ in range(12):
        finished += step(sched, worker)
    assert {f"alice/{i}" for i in range(4)} <= set(finished)
    assert sched.counters["retractions"] == 4
    assert sorted(drain(sched, worker)) == [f"bob/{i}" for i in range(8)]


def test_a_fixed_running_share_holds_a_tenant_to_it_while_another_waits() -> None:
    sched, worker = new_scheduler(max_running_requests=8, max_running_requests_per_tenant=3)
    for i in range(10):
        sched.add_request(request("bob", i, new_tokens=50))
    sched.add_request(request("alice", 0, new_tokens=50))
    step(sched, worker)
    assert running(sched, "bob") == 3 and running(sched, "alice") == 1
    drain(sched, worker)


def test_a_tenant_alone_has_the_whole_batch_and_a_wide_request_still_runs() -> None:
    sched, worker = new_scheduler(max_running_requests=8)
    for i in range(8):
        sched.add_request(request("bob", i, new_tokens=20))
    step(sched, worker)
    assert running(sched, "bob") == 8  # no other tenant: no share to keep
    drain(sched, worker)
    sched.add_request(request("alice", 0, new_tokens=20))
    sched.add_request(request("bob", 99, new_tokens=5, n=6))  # wider than the share of 4
    drain(sched, worker)


def test_one_tenants_expected_growth_does_not_keep_another_out_of_a_free_pool() -> None:
    """Issue 53, finding 1: bob's one request (n=16, 200 new tokens each) is expected to add
    ~2,200 tokens to a 1,024-token pool, so admission kept every other request out while
    most of the pool was free. Counted only up to bob's share of the pool, it leaves
    room for alice's requests, which run beside his and finish long before; bob's
    outputs all finish too (retracted by share when memory runs short)."""
    sched, worker = fake_scheduler(256, PAGE, VOCAB, 256, max_running_requests=32)
    sched.add_request(request("bob", 0, new_tokens=200, n=16))
    for _ in range(3):
        step(sched, worker)
    assert running(sched, "bob") == 16
    free = sched.cache.allocator.num_free / sched.cache.allocator.num_blocks
    assert free > 0.8  # bob's growth is only expected, not held
    for i in range(4):
        sched.add_request(request("alice", i, new_tokens=8))
    finished: list[str] = []
    for _ in range(20):
        finished += step(sched, worker)
    assert {f"alice/{i}" for i in range(4)} <= set(finished)
    assert drain(sched, worker) == ["bob/0"] * 16  # one final update per output


def test_memory_short_retracts_the_tenant_holding_the_most() -> None:
    """When decodes outgrow the pool, the request retracted is the newest of the tenant
    holding the most KV (bob's), not the newest request (alice's, admitted last). (A low
    expected growth admits them all, so that memory does run short.)"""
    sched, worker = fake_scheduler(64, PAGE, VOCAB, 256, max_running_requests=32,
                                   init_new_token_ratio=0.01, min_new_token_ratio=0.01)
    finishing = sched.running_batch.finishing
    retracted: list[str] = []
    retract = finishing.retract

    def recorded(req):  # type: ignore[no-untyped-def]
        retracted.append(req.rid)
        retract(req)

    finishing.retract = recorded  # type: ignore[method-assign]
    for i in range(3):
        sched.add_request(request("bob", i, new_tokens=200))
    for _ in range(20):
        step(sched, worker)
    sched.add_request(request("alice", 0, new_tokens=100))
    retracted.clear()
    for _ in range(80):
        step(sched, worker)
    assert retracted and all(rid.startswith("bob/") for rid in retracted), retracted
    drain(sched, worker)


def test_a_prefill_flood_takes_only_its_part_of_the_steps_that_decode_another_tenant() -> None:
    """Issue 53, finding 8: bob's long prompts took every step's whole token budget, so each
    of alice's tokens waited for ~500 tokens of bob's prefill. While alice decodes, bob's
    prompts take at most `tenant_prefill_tokens` a step; alone, the whole budget."""
    sched, worker = fake_scheduler(1024, PAGE, VOCAB, 256, max_running_requests=32,
                                   tenant_prefill_tokens=32)

    def long_prompt(i: int) -> TokenizedRequest:
        return TokenizedRequest(rid=f"bob/{i}", tenant="bob",
                                input_ids=[1 + (i * 7 + j) % 30 for j in range(600)],
                                sampling=SamplingParams(max_new_tokens=1, temperature=0))

    sched.add_request(request("alice", 0, new_tokens=40))
    step(sched, worker)  # alice's prompt
    for i in range(6):
        sched.add_request(long_prompt(i))
    finished: list[str] = []
    for _ in range(45):
        batch, updates = sched.schedule()
        assert batch is not None
        decoding = {s.req.group.tenant for s in batch.seqs if s.n == 1}
        bob_prefill = sum(s.n for s in batch.seqs
                          if s.req.group.tenant == "bob" and s.n > 1)
        if "alice" in decoding:
            assert bob_prefill <= 32, bob_prefill
        updates += sched.process_result(batch, worker.forward(batch.forward))
        finished += [u.rid for u in updates if u.finished]
        if "alice/0" in finished:
            break
    assert "alice/0" in finished  # 40 tokens in about 40 steps, bob's prompts beside them
    batch, _ = sched.schedule()  # alice done: bob's prompts have the whole budget again
    assert batch is not None and sum(s.n for s in batch.seqs) > 200
    sched.process_result(batch, worker.forward(batch.forward))
    drain(sched, worker)


@pytest.mark.parametrize("bobs", [["b1", "b1", "b2"], ["b1", "b1", "b2", "b2"]])
def test_a_tenant_holding_every_adapter_slot_gives_one_back_to_a_waiting_adapter(
        bobs: list[str]) -> None:
    """Issue 53, finding 7: with two adapter slots, bob's long requests on two adapters held
    both, and alice's request on a third never ran. Bob holds more than his part of the
    slots while alice's adapter waits: his requests on his least used adapter are retracted
    (one a step, and none started again meanwhile: with two on each adapter, the first
    retracted was admitted again at once, so the slot never freed), the slot goes to
    alice's adapter, and everyone still finishes."""
    adapters = [LoraInfo(name=n, path=n, fingerprint=n, rank=8, target_modules=[])
                for n in ("b1", "b2", "a1")]
    cfg = EngineConfig(page_size=PAGE, max_total_tokens=1024 * PAGE, chunked_prefill_size=256,
                       debug_invariants=True, enable_lora=True, max_loras_per_batch=2)
    info = WorkerInfo(model_path="fake", num_blocks=1024, page_size=PAGE, context_length=1024,
                      vocab_size=VOCAB, eos_token_ids=[0], device="cpu", dtype="float32",
                      kv_pool_bytes=0, loras=adapters)
    sched, worker = Scheduler(cfg, info), FakeWorker(1024, PAGE, VOCAB)

    def on(tenant: str, i: int, lora: str, new_tokens: int) -> TokenizedRequest:
        return sched.loras.bind(msgspec.structs.replace(
            request(tenant, i, new_tokens=new_tokens), lora=lora))

    for i, lora in enumerate(bobs):
        sched.add_request(on("bob", i, lora, 300))
    for _ in range(3):
        step(sched, worker)
    assert sorted(sched.loras.slots) == ["b1", "b2"]
    sched.add_request(on("alice", 0, "a1", 10))
    finished: list[str] = []
    for _ in range(30):
        finished += step(sched, worker)
    assert "alice/0" in finished
    assert sorted(drain(sched, worker)) == [f"bob/{i}" for i in range(len(bobs))]


def test_a_tenant_over_its_memory_share_gives_memory_back_to_a_waiting_one() -> None:
    """Bob's requests, admitted while alone with a low expected growth, fill the pool;
    alice's prompt then does not fit in what is free. Bob holds more than his share, so
    his newest requests are retracted until it does: alice runs within a few steps."""
    sched, worker = fake_scheduler(128, PAGE, VOCAB, 256, max_running_requests=32,
                                   init_new_token_ratio=0.01, min_new_token_ratio=0.01)
    for i in range(4):
        sched.add_request(request("bob", i, new_tokens=400))
    for _ in range(100):
        step(sched, worker)
    room = sched.cache.kv.available_blocks * PAGE
    alice = TokenizedRequest(rid="alice/0", tenant="alice",
                             input_ids=[1 + j % 30 for j in range(room + 40)],
                             sampling=SamplingParams(max_new_tokens=4, temperature=0))
    sched.add_request(alice)
    finished: list[str] = []
    for _ in range(40):
        finished += step(sched, worker)
    assert "alice/0" in finished
    assert sched.counters["retractions"] > 0
    drain(sched, worker)
