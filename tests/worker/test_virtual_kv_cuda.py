"""The virtual KV layout on CUDA VMM (`worker/virtual_kv_cuda.py`), on a GPU only: views
show their blocks in place, a rewritten block keeps no old view, a flush unmaps every view,
and the default model's greedy tokens equal the paged layout's (the same Triton kernels,
read through block tables there and as contiguous ranges here). Skipped without a CUDA
device, the cuda-bindings package, or with the kernels interpreted; bench/gpu_check.py's
`virtual` section runs the same comparison and times it."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("cuda.bindings")
if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    pytest.skip("the kernels are interpreted (TRITON_INTERPRET=1): run with "
                "TRITON_INTERPRET=0 on the GPU", allow_module_level=True)

from radixserve import Engine  # noqa: E402
from radixserve.worker.virtual_kv_cuda import CudaVirtualKVPool  # noqa: E402
from tests.conftest import assert_blocks_accounted  # noqa: E402

PAGE_FP32 = 45
"""The default model's fp32 blocks of 45 tokens fill a 2 MiB page to 1.1%."""


def make_pool(num_blocks: int = 8, num_slots: int = 2, slot_blocks: int = 4):
    # 16 KiB a token: 128-token blocks are one 2 MiB page each.
    return CudaVirtualKVPool(4, num_blocks, 128, 8, 64, torch.float32, num_slots=num_slots,
                             slot_blocks=slot_blocks, device=torch.device("cuda"))


class TestViews:
    def test_views_are_the_blocks_in_place(self):
        pool = make_pool()
        slots = pool.prepare([[5, 2, 7]], [300], [300], [])
        pool.blocks[2].fill_(3.0)
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


def test_default_model_matches_the_paged_layout(model_dir):
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
