"""The virtual KV layout's views and mappings (`worker/virtual_kv.py`), on tiny models:
views show their blocks in place, a reused block keeps no old view, the VMA count the
layout keeps is the kernel's and returns to its baseline after a flush, the start-up
refusals, and outputs equal to the paged layout's under eviction, forks, beams, a
sliding window and the disk tier."""

from __future__ import annotations

import gc
import random
from pathlib import Path

import pytest
import torch

from radixserve import Engine
from radixserve.worker.virtual_kv import VirtualKVPool
from radixserve.worker.vma_budget import VMA_MARGIN, process_mappings
from tests.conftest import assert_blocks_accounted, checked_engine
from tests.factories import tiny_model_dir

LAYERS, KV_HEADS, HEAD_DIM, PAGE = 2, 2, 16, 16
"""512 bytes a token over all layers: a block of 16 tokens is two memory pages, but half a
page in one layer's K or V, so the pool is one region (`plane_regions`)."""
PLANE_HEAD_DIM = 32
"""A block of 16 tokens is one memory page in one layer's K or V: a region per plane."""
GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(params=[HEAD_DIM, PLANE_HEAD_DIM], ids=["one-region", "region-per-plane"])
def make_pool(request):
    """Makes a pool in either layout; `views_budget`: the view mappings its views may hold
    (a kernel limit emulated)."""
    regions = 1 if request.param == HEAD_DIM else 2 * LAYERS

    def make(num_blocks: int = 16, num_slots: int = 3, slot_blocks: int = 4,
             views_budget: int | None = None) -> VirtualKVPool:
        limit = None if views_budget is None else (
            process_mappings() + VMA_MARGIN + regions * (views_budget + 1))
        pool = VirtualKVPool(LAYERS, num_blocks, PAGE, KV_HEADS, request.param,
                             torch.float32, num_slots=num_slots, slot_blocks=slot_blocks,
                             map_limit=limit)
        assert pool.regions == regions
        return pool
    return make


def kernel_mappings(pool: VirtualKVPool) -> int:
    """The view mappings as the kernel holds them: its VMAs (lines of /proc/self/maps) in
    each region of the slots' reservation, which must be the same in every region."""
    with open("/proc/self/maps") as f:
        vmas = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f]
    per_region = set()
    for r in range(pool.regions):
        lo = pool.base + r * pool.region_stride
        hi = lo + pool.num_slots * pool.slot_blocks * pool.unit
        per_region.add(sum(start < hi and end > lo for start, end in vmas))
    [count] = per_region
    return count


def slot_tokens(pool: VirtualKVPool, view: torch.Tensor, s: int) -> torch.Tensor:
    """A copy of what slot `s` shows of one layer's K or V (`view`, from `pool.layers`),
    token by token: `[slot_blocks * page_size, kv_heads, head_dim]`."""
    return view[s * pool.slot_blocks:(s + 1) * pool.slot_blocks].flatten(0, 1)


def step(pool: VirtualKVPool, seqs: list[tuple[list[int], int, int]]) -> list[int]:
    """`prepare` for sequences given as (block table, kv_len, q_len)."""
    tables, kv_lens, q_lens = (list(x) for x in zip(*seqs))
    return pool.prepare(tables, kv_lens, q_lens, [])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models", hidden_size=128,
                          num_heads=4, num_kv_heads=KV_HEADS, num_layers=LAYERS)


class TestViews:
    def test_a_view_is_its_blocks_in_place(self, make_pool):
        pool = make_pool()
        pool.buffer.copy_(torch.randn(pool.buffer.shape))
        [slot] = step(pool, [([3, 4, 9], 40, 40)])
        for layer, views in enumerate(pool.layers):
            for view, phys in zip(views, pool.physical[layer]):
                assert torch.equal(slot_tokens(pool, view, slot)[:40],
                                   phys[[3, 4, 9]].flatten(0, 1)[:40])
        # A write through the view lands in the block: one memory, two addresses.
        pool.layers[1][0][slot * pool.slot_blocks + 1, 1] = 7.0
        assert bool((pool.physical[1][0][4, 1] == 7.0).all())

    def test_a_running_sequence_keeps_its_slot_and_a_new_one_reuses_a_prefix(self, make_pool):
        pool = make_pool()
        [a] = step(pool, [([0, 1], 20, 20)])
        # b's prompt shares block 0 (cached by now), written by a before this step.
        a2, b = step(pool, [([0, 1], 21, 1), ([0, 2], 18, 2)])
        assert a2 == a != b
        calls = pool.stats.mmap_calls
        assert step(pool, [([0, 2], 19, 1), ([0, 1], 22, 1)]) == [b, a]
        assert pool.stats.mmap_calls == calls  # nothing to remap
        # Both finish; a new sequence whose block 0 is cached takes a slot that maps it
        # and remaps only its position 1.
        [c] = step(pool, [([0, 5], 20, 4)])
        assert c in (a, b) and pool.mapped_blocks(c) == [0, 5]
        assert pool.stats.mmap_calls == calls + pool.regions  # one mmap per region

    def test_a_reused_block_loses_its_old_views(self, make_pool):
        pool = make_pool()
        [a] = step(pool, [([0, 1], 20, 20)])
        pool.physical[0][0][1] = 1.0  # the old sequence's KV in block 1
        # The sequence ends; block 1 is freed and reused at position 0 of another slot,
        # while a third sequence takes a's slot (mapping only its position 0).
        x, b = step(pool, [([5], 3, 3), ([1], 5, 5)])
        assert x == a and b != a
        assert pool.where[1] == {(b, 0)}
        assert pool.mapped[a][:2] == [5, -1]
        pool.physical[0][0][1] = 2.0  # b writes its KV
        # a's old position 1 reads the zero reserve, not block 1 (neither old nor new KV).
        assert bool((slot_tokens(pool, pool.layers[0][0], a)[PAGE:2 * PAGE] == 0).all())

    def test_the_mapping_count_is_the_kernels(self, make_pool):
        pool = make_pool(num_blocks=32, num_slots=4, slot_blocks=6)
        base = process_mappings()
        assert kernel_mappings(pool) == 1
        # Runs of adjacent blocks merge; scattered ones do not; a shared prefix in two slots.
        step(pool, [([0, 1, 2, 3], 60, 60)])
        step(pool, [([0, 1, 2, 3], 61, 1), ([7, 13, 11, 12, 20], 70, 70),
                    ([0, 1, 2, 9], 50, 2), ([30, 31], 20, 20)])
        assert pool.mapping_count() == 12  # (1 + 1) + (4 + 1) + (2 + 1) + (1 + 1)
        assert kernel_mappings(pool) == pool.mapping_count() == pool.vmas
        assert process_mappings() - base == pool.regions * (pool.mapping_count() - 1)
        pool.release_all()
        assert process_mappings() == base and pool.mapping_count() == pool.vmas == 1

    def test_stale_views_are_reclaimed_to_keep_the_budget(self, make_pool):
        pool = make_pool(num_blocks=64, num_slots=6, slot_blocks=6, views_budget=16)
        budget = pool.budget.views_budget
        assert 14 <= budget <= 16  # the process may map a page or two meanwhile
        # Three sequences of scattered blocks finish: their slots keep their views (4 VMAs
        # each: three runs and a zero stretch).
        step(pool, [([0, 2, 4], 40, 40), ([6, 8, 10], 40, 40), ([12, 14, 16], 40, 40)])
        assert pool.vmas == kernel_mappings(pool) == 12
        # A new sequence of four scattered blocks (slot 0, as it maps none of them) could
        # take them past the budget: stale slots are unmapped first, least recently used
        # first, as few as it takes.
        [s] = step(pool, [([20, 22, 24, 26], 60, 60)])
        assert s == 0 and pool.mapped[1] == [-1] * 6
        assert pool.vmas == kernel_mappings(pool) == pool.mapping_count() <= budget
        assert pool.mapped_blocks(s) == [20, 22, 24, 26]


class TestEngine:
    def test_flush_unmaps_every_view(self, tiny_dir):
        with checked_engine(tiny_dir, kv_layout="virtual", max_total_tokens=1024,
                            max_running_requests=8, debug_invariants=True) as engine:
            prompts = [list(range(1000, 1040)) + [2000 + i] * (3 + i) for i in range(5)]
            params = {**GREEDY, "n": 2}  # 10 sequences on 8 slots: a fork waits for one
            engine.generate(input_ids=prompts, sampling_params=params)  # threads, arenas
            assert engine.flush_cache()
            gc.collect()
            base = process_mappings()
            results = engine.generate(input_ids=prompts, sampling_params=params)
            assert [r["meta_info"]["finish_reason"]["type"] for r in results] == ["length"] * 10
            pool = engine.worker.pool
            # Finished slots stay mapped until reused, counted as the kernel counts them
            # (the rest of the process may map a little meanwhile: allocator arenas, big
            # buffers).
            assert pool.mapping_count() > 8
            assert kernel_mappings(pool) == pool.mapping_count()
            assert_blocks_accounted(engine)  # flushes
            assert all(b < 0 for m in pool.mapped for b in m) and not any(pool.where.values())
            gc.collect()
            assert kernel_mappings(pool) == 1 and process_mappings() == base

    @pytest.mark.parametrize("family", [{}, dict(family="mistral", sliding_window=24)],
                             ids=["llama", "mistral_window"])
    def test_outputs_equal_the_paged_layouts_under_pressure_forks_and_beams(
            self, tmp_path_factory, family):
        model = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models", hidden_size=128,
                               num_heads=4, num_kv_heads=KV_HEADS, num_layers=LAYERS, **family)
        rng = random.Random(0)
        shared = [rng.randrange(1000, 30000) for _ in range(70)]
        prompts = [shared + [rng.randrange(1000, 30000) for _ in range(rng.randint(3, 40))]
                   for _ in range(10)]
        outputs = {}
        for layout in ("paged", "virtual"):
            # 25 blocks: retraction and eviction reuse blocks all the time; gates low
            # enough for tree attention on the shared 70 tokens.
            with checked_engine(model, kv_layout=layout, max_total_tokens=400,
                                chunked_prefill_size=48, max_running_requests=16,
                                cascade_min_shared_tokens=32, cascade_min_group_size=2,
                                cascade_cost_model=False,
                                init_new_token_ratio=0.1, min_new_token_ratio=0.05,
                                debug_invariants=True) as engine:
                out = [r["output_ids"] for r in engine.generate(input_ids=prompts,
                                                                sampling_params=GREEDY)]
                out += [r["output_ids"] for r in engine.generate(
                    input_ids=prompts[0], sampling_params={**GREEDY, "n": 4})]
                out += [r["output_ids"] for r in engine.beam_search(
                    input_ids=prompts[1], beam_width=3, max_new_tokens=8)]
                stats = engine.stats()
                assert stats["retractions"] > 0 and stats["evicted_tokens"] > 0, stats
                # Tree attention where no window binds (with one, it waits for short
                # contexts).
                assert stats["cascade_steps"] > 0 or family, stats
                outputs[layout] = out
        assert outputs["virtual"] == outputs["paged"]


    def test_the_disk_tier_loads_into_views(self, tiny_dir, tmp_path):
        # A pool for one prompt at a time: each evicts the one before to disk.
        rng = random.Random(1)
        prompts = [[rng.randrange(1000, 30000) for _ in range(120)] for _ in range(3)]
        with checked_engine(tiny_dir, max_total_tokens=4096) as paged:
            want = [r["output_ids"]
                    for r in paged.generate(input_ids=prompts, sampling_params=GREEDY)]
        with checked_engine(tiny_dir, kv_layout="virtual", max_total_tokens=192,
                            max_running_requests=4, kv_disk_dir=str(tmp_path),
                            debug_invariants=True) as engine:
            # Loading always pays (as measured at start it may not, on a warm, busy host):
            # this test is about where loads land, not whether to load.
            engine.scheduler.cache.kv.prefill_cost = 1.0
            for _ in range(2):
                got = [engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
                       for ids in prompts]
                assert got == want
            assert engine.stats()["disk_loads"] >= 3


class TestRefusals:
    def test_when_not_one_whole_context_sequence_fits(self, tiny_dir):
        # 128 blocks (2048 tokens of context) could need 129 mappings; 100 do not hold them.
        limit = process_mappings() + 1 + VMA_MARGIN + 100
        with pytest.raises(ValueError, match=r"vm\.max_map_count") as err:
            Engine(str(tiny_dir), kv_layout="virtual", virtual_max_map_count=limit)
        assert "sysctl -w vm.max_map_count=" in str(err.value)
        assert "128 blocks of 16 tokens (context_length) need up to 129" in str(err.value)

    def test_blocks_that_are_not_whole_memory_pages(self, tiny_dir):
        with pytest.raises(ValueError, match="page_size that is a multiple of 4"):
            Engine(str(tiny_dir), kv_layout="virtual", page_size=2)



class TestCudaRefusals:
    """What refuses the CUDA layout (`worker/virtual_kv_cuda.py`) is decided before any
    device memory is touched, so it is checked here without a GPU."""

    @pytest.fixture
    def on_cuda(self, monkeypatch):
        import radixserve.worker.worker as worker_module
        from radixserve.config import EngineConfig

        monkeypatch.setattr(worker_module, "resolve_device",
                            lambda name, placement=None: torch.device("cuda"))
        return lambda model_dir, **config: worker_module.Worker(
            EngineConfig(kv_layout="virtual", dtype="float32", **config), model_dir)

    def test_sdpa_is_refused(self, tiny_dir, on_cuda):
        with pytest.raises(ValueError, match="runs the Triton kernels only"):
            on_cuda(tiny_dir, attention_backend="torch")

    def test_without_cuda_bindings(self, tiny_dir, on_cuda, monkeypatch):
        import sys

        monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # import fails
        with pytest.raises(ValueError, match=r"needs the cuda-bindings package"):
            on_cuda(tiny_dir)
