"""Cache namespaces (tenants, cache_salt) in the scheduler: a request is matched, cached
and given kept partial blocks in its own namespace only, and neither LPM ordering nor the
wait for a shared prefix being computed looks at another namespace."""

from __future__ import annotations

from radixserve.config import EngineConfig
from radixserve.messages import SamplingParams, TokenizedRequest, WorkerInfo
from radixserve.scheduler.policy import order_waiting, waits_for_shared_prefix
from radixserve.scheduler.request import Req
from radixserve.scheduler.scheduler import Scheduler
from tests.scheduler.fake_worker import FakeWorker

VOCAB, PAGE = 32, 4


def new_scheduler(num_blocks: int = 64) -> tuple[Scheduler, FakeWorker]:
    config = EngineConfig(page_size=PAGE, max_total_tokens=num_blocks * PAGE,
                          chunked_prefill_size=64, debug_invariants=True)
    info = WorkerInfo(model_path="fake", num_blocks=num_blocks, page_size=PAGE,
                      context_length=1024, vocab_size=VOCAB, eos_token_ids=[0],
                      device="cpu", dtype="float32", kv_pool_bytes=0)
    return Scheduler(config, info), FakeWorker(num_blocks, PAGE, VOCAB)


def run(sched: Scheduler, worker: FakeWorker, rid: str, prompt: list[int],
        namespace: str | None, out: list[int] | None = None) -> int:
    """Run one greedy request to the end; its cached_tokens (its tokens go to `out`)."""
    sched.add_request(TokenizedRequest(
        rid=rid, input_ids=prompt, namespace=namespace,
        sampling=SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)))
    cached = None
    while sched.has_work:
        batch, updates = sched.schedule()
        if batch is not None:
            updates += sched.process_result(batch, worker.forward(batch.forward))
        for u in updates:
            if u.rid == rid and out is not None:
                out.extend(u.new_token_ids)
            if u.rid == rid and u.finished:
                cached = u.cached_tokens
    sched.check_invariants()
    assert cached is not None
    return cached


PROMPT = [(7 * i + 3) % (VOCAB - 2) + 2 for i in range(41)]  # 10 pages and a token


def test_a_prompt_cached_in_one_namespace_is_cold_in_every_other() -> None:
    sched, worker = new_scheduler()
    assert run(sched, worker, "a1", PROMPT, "a") == 0
    assert run(sched, worker, "b1", PROMPT, "b") == 0  # B sends A's prompt: a cold prefill
    assert run(sched, worker, "d1", PROMPT, None) == 0
    assert run(sched, worker, "a2", PROMPT, "a") == 40  # A's repeat hits its own cache
    assert run(sched, worker, "b2", PROMPT, "b") == 40  # and B's second hits B's copy
    assert sched.stats()["prompt_cached_tokens"] == 80
    assert sched.flush_cache()
    assert sched.cache.allocator.num_free == sched.cache.allocator.num_blocks


def test_kept_partial_blocks_stay_in_their_namespace() -> None:
    """A prompt shorter than a page is matched at the root, shared by every namespace:
    the kept partial block it leaves must still not serve another namespace."""
    sched, worker = new_scheduler()
    generated: list[int] = []
    run(sched, worker, "a1", PROMPT[:1], "a", generated)  # 1 + 3 tokens: KV of 3, no page
    assert sched.stats()["partial_blocks"] == 1
    follow_up = PROMPT[:1] + generated + [9]  # continues what that block holds
    run(sched, worker, "b1", follow_up, "b")
    assert sched.cache.kv.partial_tokens == 0  # B got no copy of A's partial block
    run(sched, worker, "a2", follow_up, "a")
    assert sched.cache.kv.partial_tokens == 3  # A did
    assert sched.flush_cache()
    assert sched.cache.allocator.num_free == sched.cache.allocator.num_blocks


def _req(rid: str, prompt: list[int], namespace: str | None) -> Req:
    return Req(rid=rid, index=0, input_ids=prompt, seed=0, namespace=namespace,
               sampling=SamplingParams(max_new_tokens=1))


def test_lpm_order_ignores_other_namespaces() -> None:
    sched, worker = new_scheduler()
    other = [5] * 41
    run(sched, worker, "a1", other, "a")  # A has `other` cached
    waiting = [_req("b1", PROMPT, "b"), _req("b2", other, "b")]
    radix_cache = sched.cache.radix_cache
    assert [r.rid for r in order_waiting("lpm", waiting, radix_cache)] == ["b1", "b2"]
    waiting.append(_req("a2", other, "a"))  # A's own request does move up
    assert [r.rid for r in order_waiting("lpm", waiting, radix_cache)] == ["a2", "b1", "b2"]


def test_no_wait_for_another_namespace_computing_the_same_prefix() -> None:
    sched, _ = new_scheduler()
    computing = _req("a1", PROMPT, "a")  # nothing computed yet (kv_len 0)
    radix_cache = sched.cache.radix_cache
    assert waits_for_shared_prefix(_req("a2", PROMPT, "a"), [computing], radix_cache)
    assert not waits_for_shared_prefix(_req("b1", PROMPT, "b"), [computing], radix_cache)
