"""The Triton kernels in bf16 on a GPU against their torch references in fp32 on the same
bf16 values, on random ragged shapes: paged decode (split or not, sliding windows), extend
(windows too) and store_kv. The interpreter cannot run bf16 dots (triton-lang/triton#11584),
so the CPU suite checks fp16 and fp32 (tests/kernels/) and this needs a GPU; its timing is
bench/gpu/run.py's."""

from __future__ import annotations

import os

import pytest
import torch

from bench.gpu.timing import paged, rel

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    reason="needs a CUDA device, with the kernels compiled (TRITON_INTERPRET=0)")


def test_kernels_match_the_torch_reference_in_bf16() -> None:
    from radixserve.kernels.decode_attention import paged_decode_attention
    from radixserve.kernels.extend_attention import extend_attention
    from radixserve.kernels.store_kv import store_kv
    from radixserve.worker.attention import paged_torch as reference

    gen = torch.Generator(device="cuda").manual_seed(0)
    bf16, worst = torch.bfloat16, {"decode": 0.0, "extend": 0.0, "store_kv": 0.0,
                                   "decode window": 0.0, "extend window": 0.0}
    for page, (hkv, group), d in [(1, (3, 3), 64), (16, (8, 4), 128), (64, (2, 8), 128),
                                  (16, (4, 1), 64), (16, (3, 3), 80)]:
        lens = torch.randint(1, 3000, (13,), generator=gen, device="cuda").tolist()
        lens += [1, page, page + 1]
        k, v, tables, kv_lens = paged(lens, page, hkv, d, bf16, gen)
        safe = tables.clamp(min=0)
        q = torch.randn(len(lens), hkv * group, d, generator=gen, device="cuda").to(bf16)
        ref = reference.paged_decode_attention(q.float(), k.float(), v.float(), safe, kv_lens,
                                               d ** -0.5)
        for splits in (1, 4, None):
            out = torch.full_like(q, float("nan"))
            paged_decode_attention(q, k, v, tables, kv_lens, d ** -0.5, num_splits=splits,
                                   out=out)
            worst["decode"] = max(worst["decode"], rel(out, ref))
        for window in (1, 100, 1024):  # sliding windows (Mistral, windowed Qwen)
            ref_w = reference.paged_decode_attention(q.float(), k.float(), v.float(), safe,
                                                     kv_lens, d ** -0.5, window=window)
            for splits in (1, 4):
                out = torch.full_like(q, float("nan"))
                paged_decode_attention(q, k, v, tables, kv_lens, d ** -0.5, num_splits=splits,
                                       out=out, window=window)
                worst["decode window"] = max(worst["decode window"], rel(out, ref_w))
        q_lens = [min(n, int(x)) for n, x in zip(lens, torch.randint(
            1, 700, (len(lens),), generator=gen, device="cuda").tolist())]
        q_start = torch.tensor([0] + q_lens, device="cuda").cumsum(0).to(torch.int32)
        qe = torch.randn(int(q_start[-1]), hkv * group, d, generator=gen,
                         device="cuda").to(bf16)
        ref = reference.extend_attention(qe.float(), k.float(), v.float(), safe, q_start,
                                         kv_lens, d ** -0.5)
        out = torch.full_like(qe, float("nan"))
        extend_attention(qe, k, v, tables, q_start, kv_lens, d ** -0.5, out=out)
        worst["extend"] = max(worst["extend"], rel(out, ref))
        for window in (1, 100, 1024):
            ref_w = reference.extend_attention(qe.float(), k.float(), v.float(), safe, q_start,
                                               kv_lens, d ** -0.5, window=window)
            out = torch.full_like(qe, float("nan"))
            extend_attention(qe, k, v, tables, q_start, kv_lens, d ** -0.5, out=out,
                             window=window)
            worst["extend window"] = max(worst["extend window"], rel(out, ref_w))
        slots = torch.randperm(k.shape[0] * page, generator=gen, device="cuda")[:500]
        new_k = torch.randn(500, hkv, d, generator=gen, device="cuda").to(bf16)
        k2, v2 = k.clone(), v.clone()
        reference.store_kv(k, v, slots, new_k, -new_k)
        store_kv(k2, v2, slots, new_k, -new_k)
        worst["store_kv"] = max(worst["store_kv"], float(k2.ne(k).sum() + v2.ne(v).sum()))
    assert {name: err for name, err in worst.items() if err > 1e-2 and name != "store_kv"} == {}
    assert worst["store_kv"] == 0, "store_kv wrote elements the reference did not"
