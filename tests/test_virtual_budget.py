"""The virtual KV layout's memory-mapping budget (worker/vma_budget.py,
scheduler/mappings.py): with every option at its default the layout starts on a kernel at
`vm.max_map_count` 65530 (where the worst case of 128 slots x 512 blocks does not fit) and
serves, the default model's greedy output equal to transformers; a budget filled on purpose
defers requests and serves them all; the views never hold more than the budget."""

from __future__ import annotations

import gc
import random
from pathlib import Path

import pytest

from radixserve import Engine
from radixserve.worker.vma_budget import VMA_MARGIN, process_mappings
from tests.conftest import assert_blocks_accounted, checked_engine
from tests.factories import tiny_model_dir
from tests.hf_reference import assert_matches_reference
from tests.test_engine_exact import QUESTIONS, SYSTEM, chat
from tests.worker.test_virtual_kv import kernel_mappings

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def long_context_tiny(tmp_path_factory) -> Path:
    """A tiny random model with the default model's 8192-token context (512 blocks) and
    30 layers, whose K and V rows of a block are one memory page each: 60 regions, so a
    view mapping costs what it does for the default model."""
    return tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models",
                          max_position_embeddings=8192, num_layers=30, hidden_size=128)


def watch_steps(engine) -> list[tuple[int, int, int]]:
    """After each step: (sequences in it, the views' VMAs as the pool counts them, as the
    kernel does; 0 in the paged layout), with the pool's recount checked against its own."""
    steps, forward, pool = [], engine.worker.forward, engine.worker.pool
    virtual = engine.config.kv_layout == "virtual"

    def spy(batch):
        result = forward(batch)
        vmas = pool.mappings()[0]
        assert not virtual or vmas == pool.mapping_count()
        steps.append((len(batch.q_lens), vmas, kernel_mappings(pool) if virtual else 0))
        return result

    engine.worker.forward = spy
    return steps


def test_defaults_start_and_match_transformers(model_dir, hf, tokenizer):
    """`Engine(kv_layout="virtual")` and nothing else: shared prefixes, forks, and the
    views back to the reservation alone after a flush."""
    engine = Engine(str(model_dir), kv_layout="virtual")
    try:
        stats = engine.stats()
        assert engine.config.max_running_requests == 128 and engine.worker.context_length == 8192
        # A region per layer's K and V: the kernel's 65530 over 60, which still holds a
        # sequence of the whole context (513 view mappings at worst) twice.
        regions = engine.worker.pool.regions
        assert regions == 60 and 2 * 513 < stats["kv_mapping_budget"] < 65530 // 60, stats
        system = SYSTEM[:SYSTEM.index("Repairs")]
        prompts = [chat(tokenizer, q, system) for q in QUESTIONS[:3]]
        results = engine.generate(input_ids=prompts, sampling_params={
            **GREEDY, "max_new_tokens": 8, "n": 2})
        assert len(results) == 6
        for i, res in enumerate(results):
            assert_matches_reference(res["output_ids"], hf.greedy(prompts[i // 2], 8),
                                     f"prompt {i // 2}")
        stats = engine.stats()
        assert stats["prompt_cached_tokens"] > 0 and stats["kv_mappings"] > 1, stats
        engine.check_invariants()
        assert_blocks_accounted(engine)  # flushes
        assert engine.worker.pool.mapping_count() == 1 == engine.stats()["kv_mappings"]
        assert kernel_mappings(engine.worker.pool) == 1
    finally:
        engine.shutdown()


def test_128_concurrent_sequences_of_mixed_length(long_context_tiny):
    """The default slots and budget on a model of the default context and mapping cost:
    128 sequences at once, decoding side by side, none refused or retracted (a pool twice
    the CPU default, so that KV memory does not hold them back either). Their decode
    blocks stay runs (`BlockAllocator.alloc`'s `after`): interleaved block by block, they
    would pass the budget of about 1060 view mappings."""
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 30000) for _ in range(rng.randint(5, 200))]
               for _ in range(128)]
    with checked_engine(long_context_tiny, kv_layout="virtual", max_total_tokens=65536,
                        debug_invariants=True) as engine:
        steps = watch_steps(engine)
        results = engine.generate(input_ids=prompts, sampling_params={
            **GREEDY, "max_new_tokens": 128})
        assert [r["meta_info"]["finish_reason"]["type"] for r in results] == ["length"] * 128
        assert max(n for n, *_ in steps) == 128 and engine.worker.pool.regions == 60
        assert engine.stats()["retractions"] == 0
        budget = engine.stats()["kv_mapping_budget"]
        assert all(vmas == kernel <= budget for _, vmas, kernel in steps)


def test_a_full_budget_defers_requests_and_serves_them_all(tmp_path_factory):
    """A kernel limit emulated so low that the views hold about 50 mappings (a sequence of
    the whole 256-token context needs 17 at most): 64 requests that the slots and the pool
    would run at once run a few at a time, none refused, each as the paged layout serves
    it; the views never hold more than the budget."""
    tiny = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")
    rng = random.Random(1)
    shared = [rng.randrange(1000, 30000) for _ in range(64)]
    prompts = [shared[:rng.choice([0, 32, 64])] +
               [rng.randrange(1000, 30000) for _ in range(rng.randint(3, 150))]
               for _ in range(64)]
    params = {**GREEDY, "max_new_tokens": 40}
    common = dict(max_running_requests=64, context_length=256, debug_invariants=True)
    with checked_engine(tiny, **common) as engine:
        steps = watch_steps(engine)
        want = [r["output_ids"] for r in engine.generate(input_ids=prompts,
                                                         sampling_params=params)]
        assert max(n for n, *_ in steps) == 64  # the paged layout runs them all at once
    gc.collect()  # an earlier engine's views, unmapped when collected
    limit = process_mappings() + 1 + VMA_MARGIN + 50
    with checked_engine(tiny, kv_layout="virtual", virtual_max_map_count=limit,
                        **common) as engine:
        budget = engine.stats()["kv_mapping_budget"]
        assert 30 < budget < 70  # what the process maps meanwhile moves it a little
        steps = watch_steps(engine)
        results = engine.generate(input_ids=prompts, sampling_params=params)
        assert [r["output_ids"] for r in results] == want
        assert [r["meta_info"]["finish_reason"]["type"] for r in results] == ["length"] * 64
        # Each running sequence costs two mappings or more (a run and its zero stretch).
        assert max(n for n, *_ in steps) <= budget // 2
        assert all(vmas == kernel <= budget for _, vmas, kernel in steps)
