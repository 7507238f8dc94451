"""The virtual KV layout on CUDA VMM (`worker/virtual_kv_cuda.py`).

Without a GPU: `CudaVirtualKVPool` on a fake driver that gives CUDA's VMM calls host
memory and enforces their rules (`fake_cuda.py`: map whole handles at offset 0, only onto
unmapped addresses, and set access after; unmap only whole mappings; free only what is
unmapped), so its call discipline, its padded units and the Triton kernels over its
per-block views (interpreted) are checked here; the handle bookkeeping, the mapping
thread and the layouts in `test_virtual_kv_cuda_handles.py`. On a GPU (`TestOnGPU`, skipped without
a CUDA device, the cuda-bindings package, or with the kernels interpreted): the real driver,
views in place, a rewritten block keeps no old view, a flush unmaps every view, and the
default model's greedy tokens equal the paged layout's. bench/gpu/run.py's `virtual`
section runs that comparison too and times it."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from radixserve import Engine
from radixserve.worker.virtual_kv_cuda import CudaVirtualKVPool
from tests.conftest import assert_blocks_accounted
from tests.worker.fake_cuda import GRANULE


def host_pool(num_blocks: int = 8, num_slots: int = 3, slot_blocks: int = 4) -> CudaVirtualKVPool:
    """2 layers x 2 KV heads x 16 dims in fp32 (512 bytes a token): blocks of 120 tokens,
    61,440 bytes, padded to one 64 KiB granule (6% padding)."""
    return CudaVirtualKVPool(2, num_blocks, 120, 2, 16, torch.float32, num_slots=num_slots,
                             slot_blocks=slot_blocks, device=torch.device("cpu"))


class TestOnAFakeDriver:
    def test_padded_views_show_the_blocks(self, fake_cuda):
        pool = host_pool()
        assert pool.layout.name == "block" and pool.unit == GRANULE
        assert pool.layout.used == 61440
        slots = pool.prepare([[5, 2, 7]], [300], [300], [])
        pool.buffer[:, :, 2].fill_(3.0)
        k_view, v_view = pool.layers[1]
        first = slots[0] * pool.slot_blocks
        assert bool((k_view[first + 1] == 3.0).all()) and bool((v_view[first + 1] == 3.0).all())
        k_view[first + 2, 5] = 9.0  # through the view, into the pool
        assert bool((pool.physical[1][0][7, 5] == 9.0).all())
        assert len(fake_cuda.mapped) == 8 + 3 and fake_cuda.accessible == set(fake_cuda.mapped)

    def test_remapping_unmaps_first_and_release_unmaps_all(self, fake_cuda):
        pool = host_pool()
        pool.prepare([[1, 2, 3]], [360], [360], [])
        pool.write_blocks([2], pool.read_blocks([0]))  # block 2 holds other tokens now
        assert pool.mapping_count() == 1 + 2 and len(fake_cuda.mapped) == 8 + 2
        # A new sequence reusing the slot's first block: only what differs is remapped
        # (each position unmapped before it is mapped again: the fake asserts it).
        pool.prepare([[1, 6, 4, 5]], [400], [400 - 120], [])
        assert pool.mapped_blocks(0) == [1, 6, 4, 5]
        pool.release_all()
        assert pool.mapping_count() == 1 and len(fake_cuda.mapped) == 8

    def test_freed_in_full(self, fake_cuda):
        pool = host_pool()
        pool.prepare([[1, 2], [1, 3]], [200, 200], [200, 200], [])
        del pool
        gc.collect()
        assert fake_cuda.mapped == {} and fake_cuda.reserved == {} and fake_cuda.handles == {}

    def test_triton_kernels_read_the_padded_views(self, fake_cuda):
        """Decode over the views (`contiguous=True`, strided per block by the padding)
        equals the reference over the pool's own blocks."""
        pytest.importorskip("triton")
        from radixserve.kernels.decode_attention import paged_decode_attention
        from radixserve.worker.attention import paged_torch as reference
        from radixserve.worker.attention.triton_backend import interpreting

        if not interpreting():
            pytest.skip("the kernels run on the CPU only with TRITON_INTERPRET=1")
        pool = host_pool(num_blocks=12)
        tables = [[4, 9, 1], [4, 9, 11, 0], [7]]
        kv_lens = [300, 430, 5]
        slots = pool.prepare(tables, kv_lens, [1, 1, 1], [])
        pool.buffer.normal_()
        q = torch.randn(3, 4, 16)
        k_view, v_view = pool.layers[0]
        got = paged_decode_attention(q, k_view, v_view, pool.view_tables(slots, 4),
                                     torch.tensor(kv_lens, dtype=torch.int32), 0.25,
                                     contiguous=True)
        padded = torch.tensor([t + [0] * (4 - len(t)) for t in tables])
        want = reference.paged_decode_attention(q, *pool.physical[0], padded,
                                                torch.tensor(kv_lens), 0.25)
        assert float((got - want).abs().max()) < 1e-5

    def test_a_page_size_that_pads_too_much_is_refused(self, fake_cuda):
        with pytest.raises(ValueError, match=r"such as 128 \(0\.0% padding\)"):
            CudaVirtualKVPool(2, 8, 30, 2, 16, torch.float32, num_slots=2, slot_blocks=4,
                              device=torch.device("cpu"))


gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    reason="needs a CUDA device, with the kernels compiled (TRITON_INTERPRET=0)")
PAGE_FP32 = 45
"""The default model's fp32 blocks of 45 tokens fill a 2 MiB page to 1.1%."""


def make_pool(num_blocks: int = 8, num_slots: int = 2, slot_blocks: int = 4):
    # 16 KiB a token: 128-token blocks are one 2 MiB page each.
    return CudaVirtualKVPool(4, num_blocks, 128, 8, 64, torch.float32, num_slots=num_slots,
                             slot_blocks=slot_blocks, device=torch.device("cuda"))


@gpu
class TestOnGPU:
    @pytest.fixture(autouse=True)
    def _bindings(self):
        pytest.importorskip("cuda.bindings")

    def test_views_are_the_blocks_in_place(self):
        pool = make_pool()
        slots = pool.prepare([[5, 2, 7]], [300], [300], [])
        pool.buffer[:, :, 2].fill_(3.0)
        k_view, _ = pool.layers[1]
        first = slots[0] * pool.slot_blocks
        assert bool((k_view[first + 1] == 3.0).all())
        k_view[first + 2, 5] = 9.0  # written through the view, seen in the pool
        assert bool((pool.physical[1][0][7, 5] == 9.0).all())

    def test_a_rewritten_block_keeps_no_old_view(self):
        pool = make_pool()
        pool.prepare([[1, 2]], [256], [256], [])
        assert pool.mapping_count() == 3
        pool.write_blocks([2], pool.read_blocks([0]))  # block 2 holds other tokens now
        assert pool.mapping_count() == 2 and 2 not in pool.mapped_blocks(0)

    def test_release_unmaps_every_view(self):
        pool = make_pool()
        pool.prepare([[1, 2], [1, 3]], [256, 256], [256, 256], [])
        pool.release_all()
        assert pool.mapping_count() == 1
        assert pool.mapped_blocks(0) == pool.mapped_blocks(1) == []


    def test_default_model_matches_the_paged_layout(self, model_dir):
        system = "You are a careful assistant. " + " ".join(
            f"Fact {i}: item {i} costs {i * 7 % 101} coins." for i in range(40))
        prompts = [system + f" Question: how many coins does item {i} cost?" for i in range(6)]
        params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
        outputs = {}
        for layout in ("paged", "virtual"):
            with Engine(str(model_dir), device="cuda", dtype="float32", kv_layout=layout,
                        attention_backend="triton", page_size=PAGE_FP32, max_running_requests=8,
                        chunked_prefill_size=64, max_total_tokens=PAGE_FP32 * 64,
                        cascade_min_shared_tokens=64, cascade_min_group_size=2,
                        debug_invariants=True) as engine:
                engine.generate(prompt=prompts[:1], sampling_params=params)  # cache the prefix
                outputs[layout] = [r["output_ids"] for r in
                                   engine.generate(prompt=prompts, sampling_params=params)]
                assert_blocks_accounted(engine)
                if layout == "virtual":
                    assert engine.worker.pool.mapping_count() == 1
        assert outputs["virtual"] == outputs["paged"]
