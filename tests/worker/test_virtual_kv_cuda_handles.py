"""The virtual KV layout on CUDA without a GPU (`fake_cuda.py`'s driver): one physical
handle per block and region, made once and each mapped whole at offset 0; the views equal
the blocks after remaps; a flush brings the mappings back to their floor; the next step's
blocks mapped ahead on the mapping thread, and a step's waits counted; the two page
layouts (`worker/virtual_pages.py`) and the refusal of a wasteful one."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from radixserve.messages import SeqSampling
from radixserve.worker.seq_rows import SeqRows, whole_tables_step
from radixserve.worker.virtual_kv_cuda import CudaVirtualKVPool
from radixserve.worker.virtual_pages import choose
from tests.worker.fake_cuda import GRANULE

MIB2 = 2 << 20


def make_pool(layout: str, num_blocks: int = 12) -> CudaVirtualKVPool:
    """2 layers x 2 KV heads x 16 dims in fp32 (128 bytes a token per layer's K or V):
    `block` at page_size 120 (one 64 KiB unit a block, 6% padding), `layer` at 512 (four
    units a block, one per layer's K and V, none padded)."""
    page = 120 if layout == "block" else 512
    return CudaVirtualKVPool(2, num_blocks, page, 2, 16, torch.float32, num_slots=3,
                             slot_blocks=4, device=torch.device("cpu"), page_layout=layout)


def step(pool: CudaVirtualKVPool, tables, kv_lens, q_lens) -> list[int]:
    """One step as the worker makes it: prepare, then map ahead (the kernels run here)."""
    slots = pool.prepare(tables, kv_lens, q_lens, [])
    sample = SeqSampling(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, seed=0, step=0)
    batch = whole_tables_step(tables, [0] * sum(q_lens), q_lens, kv_lens,
                              [sample] * len(tables), [None] * len(tables))
    rows = SeqRows(torch.device("cpu"))
    pool.map_ahead(rows.step(batch, rows.apply(batch), pool.page_size))
    return slots


def assert_views_show_the_blocks(pool: CudaVirtualKVPool) -> None:
    pool.buffer.normal_()
    for s in range(pool.num_slots):
        for p, b in enumerate(pool.mapped[s]):
            for view, physical in zip(pool.layers, pool.physical):
                for kv in (0, 1):
                    if b >= 0:
                        assert torch.equal(view[kv][s * pool.slot_blocks + p], physical[kv][b])


@pytest.mark.parametrize("layout", ["block", "layer"])
def test_one_handle_per_unit_mapped_whole_and_released(fake_cuda, layout):
    pool = make_pool(layout)
    assert pool.layout.name == layout and pool.regions == (1 if layout == "block" else 4)
    made = fake_cuda.created
    assert made == pool.regions * pool.num_blocks  # the linear range maps each once
    assert fake_cuda.maps == made and pool.mapping_count() == 1
    pool.prepare([[1, 2, 3]], [3 * pool.page_size], [3 * pool.page_size], [])
    pool.write_blocks([2], pool.read_blocks([0]))  # block 2 holds other tokens now
    # A new sequence reusing the slot's first block, and another beside it: what differs
    # is remapped, each position unmapped before it is mapped (the fake asserts it).
    pool.prepare([[1, 6, 4, 5], [7, 8]], [pool.page_size * 4, 10], [pool.page_size * 3, 10], [])
    assert pool.mapped_blocks(0) == [1, 6, 4, 5] and pool.mapping_count() == 1 + 6
    assert len(fake_cuda.mapped) == pool.regions * (pool.num_blocks + 6)
    assert_views_show_the_blocks(pool)
    assert fake_cuda.created == made  # nothing allocated on the serving path
    pool.release_all()  # a flush
    assert pool.mapping_count() == 1 and len(fake_cuda.mapped) == made
    del pool
    gc.collect()
    assert fake_cuda.handles == {} and fake_cuda.mapped == {} and fake_cuda.reserved == {}


def test_a_layers_rows_are_one_stretch_in_the_layer_layout(fake_cuda):
    """In the layer layout a view position is one layer's K (or V) alone, so consecutive
    blocks of a slot are consecutive rows; in the block layout they are a unit apart."""
    layer, block = make_pool("layer"), make_pool("block")
    k_view = layer.layers[1][0]
    assert k_view.stride(0) == layer.page_size * 2 * 16 and k_view[0:4].is_contiguous()
    assert block.layers[1][0].stride(0) == GRANULE // 4


class TestMapAhead:
    def test_the_next_block_is_mapped_while_the_step_runs(self, fake_cuda):
        pool = make_pool("block", num_blocks=16)
        page = pool.page_size
        step(pool, [[3]], [page], [page])  # a prefill filling block 3: mapped on its path
        assert pool.mapped_blocks(0) == [3, 4]  # (waits for the thread)
        assert pool.stats.map_waits == 1 and pool.stats.mapped_ahead == 1
        maps = fake_cuda.maps
        # The decode's next token goes into block 4, as the allocator hands it out: mapped.
        step(pool, [[3, 4]], [page + 1], [1])
        assert fake_cuda.maps == maps and pool.stats.map_waits == 1
        assert_views_show_the_blocks(pool)
        for kv in range(page + 2, 2 * page + 1):
            step(pool, [[3, 4]], [kv], [1])
        assert pool.mapped_blocks(0) == [3, 4, 5]  # (the thread given its time)
        # Predicted: block 5. The scheduler gave 9: mapped on the step's path, a wait.
        step(pool, [[3, 4, 9]], [2 * page + 1], [1])
        assert pool.stats.map_waits == 2 and pool.mapped_blocks(0)[:3] == [3, 4, 9]
        assert_views_show_the_blocks(pool)
        pool.release_all()  # with the thread's last job (block 10 ahead) settled first
        assert pool.mapping_count() == 1

    def test_a_step_waits_for_a_slow_mapping_and_counts_it(self, fake_cuda):
        pool = make_pool("block")
        page = pool.page_size
        fake_cuda.gate = threading.Event()
        # The prefill is mapped on its path; the thread's map of block 4 is held at the gate.
        step(pool, [[3]], [page], [page])
        assert pool.stats.map_waits == 1
        timer = threading.Timer(0.3, fake_cuda.gate.set)
        timer.start()
        start, seconds = time.perf_counter(), pool.stats.map_wait_seconds
        maps = fake_cuda.maps
        pool.prepare([[3, 4]], [page + 1], [1], [])
        waited = time.perf_counter() - start
        timer.join()
        assert fake_cuda.maps == maps + 1  # the thread's map alone
        assert pool.stats.map_waits == 2 and pool.stats.mapped_ahead == 1
        assert 0.2 < pool.stats.map_wait_seconds - seconds <= waited
        assert_views_show_the_blocks(pool)

    def test_only_blocks_the_step_does_not_read_are_mapped_ahead(self, fake_cuda):
        """A table whose next block another running sequence holds: not touched while the
        step's kernels read it."""
        pool = make_pool("block")
        page = pool.page_size
        step(pool, [[3], [4]], [page, 10], [page, 10])
        assert pool.mapped_blocks(0) == [3] and pool.mapped_blocks(1) == [4]
        assert pool.stats.mapped_ahead == 0


class TestPageLayouts:
    def test_the_default_follows_the_model_shape(self):
        # The default model in bf16 (30 layers, 3 KV heads x 64: 384 bytes a layer's K).
        assert choose("auto", 30, 91, 384, MIB2).name == "block"
        assert choose("auto", 30, 5461, 384, MIB2).name == "layer"
        # Llama-3-8B in bf16 (32 layers, 8 KV heads x 128: 2 KiB).
        block = choose("auto", 32, 16, 2048, MIB2)
        assert block.name == "block" and block.padding == 0 and block.block_bytes == MIB2
        layer = choose("auto", 32, 1024, 2048, MIB2)
        assert layer.name == "layer" and layer.padding == 0 and layer.regions == 64

    def test_a_wasteful_layout_is_refused_naming_a_better_one(self):
        with pytest.raises(ValueError, match=r"98% .* use virtual_page_layout='block'"):
            choose("layer", 30, 91, 384, MIB2)
        # 16 of the default model's tokens would leave 82% of a 2 MiB page as padding.
        with pytest.raises(ValueError, match=r"82% .* such as 91 \(0\.0% padding\)"):
            choose("block", 30, 16, 384, MIB2)
        with pytest.raises(ValueError, match=r"such as 5461 \(0\.0% padding\)"):
            choose("layer", 30, 16, 384, MIB2)
        with pytest.raises(ValueError, match="must be auto, block or layer"):
            choose("planes", 30, 91, 384, MIB2)  # type: ignore[arg-type]
