"""One-command GPU check of the Triton attention path (sized for < 8 minutes on one H200).

    python bench/gpu_check.py --out $OUT

Sections (each guarded: a failure is recorded and the rest still run):
1. correctness: every kernel against its torch reference in bf16 on random ragged shapes
   (reference in fp32 on the same bf16 values; target: max relative error <= 1e-2);
2. copy bandwidth: a large device-to-device copy (read + write bytes / time);
3. paged decode, batch 64 x 4k context: achieved bandwidth (KV + q + out bytes / time)
   against the copy bandwidth (target >= 70%), plus a small sweep of launch knobs;
4. tree (cascade) attention: a decode step of 64 sequences in 8 groups of 8 over a
   1,000-token prefix per group (64-token private suffixes) through the Triton backend,
   with the step's cascade plan and without (per-layer attention time, GB/s of KV read,
   speedup; agreement of the two outputs), plus a small sweep of the cascade launch knobs;
5. extend vs torch SDPA (flash backend) on the same shapes laid out contiguously
   (target: Triton time <= 1.3x SDPA), plus a small sweep of tile configs;
6. the virtual KV layout on CUDA VMM (`worker/virtual_kv_cuda.py`), in both page layouts
   (`worker/virtual_pages.py`: `block` at page size 91, whose bf16 blocks fill 2 MiB pages;
   `layer` at 5,461): the cost of mapping a block, the decode kernel over the views
   (`contiguous=True`) against the paged read of the same blocks at batch 8/32/64 x 2k
   context, the default model's greedy outputs virtual vs paged, the steps that waited
   for a mapping (the rest were mapped ahead), and the views unmapped after a flush;
7. `--quantization int8|q4` on CUDA: refused at start-up (no CUDA kernels are wired);
8. tensor parallelism over 2 GPUs (NCCL): `Engine(tp_size=2)`'s greedy outputs against
   `tp_size=1`'s in float32, and a batch-64 decode step of each (skipped, saying why, on
   a machine with fewer than 2 GPUs);
9. end to end: the shared-prefix workload through `radixserve.Engine` with the default
   model (cache hit rate, throughput, greedy agreement with the torch backend).
Prints one table and writes `gpu_check.json` under `--out`. Timings use CUDA events.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

if __package__ in (None, ""):  # bench.* and tests.factories (the tensor-parallel model)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROWS: list[dict[str, Any]] = []
T0 = time.perf_counter()


def row(section: str, name: str, value: Any, target: str = "", ok: bool | None = None,
        **extra: Any) -> None:
    ROWS.append(dict(section=section, name=name, value=value, target=target, ok=ok, **extra))
    shown = f"{value:.4g}" if isinstance(value, float) else value
    print(f"[{time.perf_counter() - T0:6.1f}s] {section}: {name} = {shown} {target}", flush=True)


def cuda_time(fn: Callable[[], Any], iters: int = 30, warmup: int = 3) -> float:
    """Mean seconds per call, CUDA events around `iters` back-to-back calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def paged(lens: list[int], page: int, hkv: int, d: int, dtype: torch.dtype,
          gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random caches, shuffled block tables (int32, padded with -1) and kv_lens on cuda."""
    need = [-(-n // page) for n in lens]
    nblocks = sum(need) + 1
    k = torch.randn(nblocks, page, hkv, d, generator=gen, device="cuda").to(dtype)
    v = torch.randn(nblocks, page, hkv, d, generator=gen, device="cuda").to(dtype)
    perm = torch.randperm(nblocks, generator=gen, device="cuda").to(torch.int32)
    tables = torch.full((len(lens), max(need)), -1, dtype=torch.int32, device="cuda")
    at = 0
    for b, nb in enumerate(need):
        tables[b, :nb] = perm[at:at + nb]
        at += nb
    return k, v, tables, torch.tensor(lens, dtype=torch.int32, device="cuda")


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


def section_correctness() -> None:
    from radixserve.kernels import reference
    from radixserve.kernels.decode_attention import paged_decode_attention
    from radixserve.kernels.extend_attention import extend_attention
    from radixserve.kernels.store_kv import store_kv

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
    for name in ("decode", "extend", "decode window", "extend window"):
        row("correctness", f"{name} bf16 max rel err", worst[name], "<= 1e-2",
            worst[name] <= 1e-2)
    row("correctness", "store_kv mismatched elements", worst["store_kv"], "== 0",
        worst["store_kv"] == 0)


def section_bandwidth(results: dict[str, float]) -> None:
    n = 2 * 2**30  # bytes per buffer
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), iters=20)
    results["copy"] = 2 * n / t
    row("bandwidth", "device copy (read+write) GB/s", results["copy"] / 1e9)


def section_decode(results: dict[str, float]) -> None:
    from radixserve.kernels import decode_attention as dm

    gen = torch.Generator(device="cuda").manual_seed(1)
    batch, ctx = 64, 4096
    for label, (hkv, group, d), page in [("smollm2 9/3x64", (3, 3, 64), 16),
                                         ("llama8b 32/8x128", (8, 4, 128), 16),
                                         ("llama8b 32/8x128", (8, 4, 128), 1)]:
        k, v, tables, kv_lens = paged([ctx] * batch, page, hkv, d, torch.bfloat16, gen)
        q = torch.randn(batch, hkv * group, d, device="cuda").to(torch.bfloat16)
        nbytes = 2 * batch * ctx * hkv * d * 2 + 2 * q.numel() * 2 + tables.numel() * 4
        best = None
        for block_n, warps in [(64, 4), (32, 4), (128, 4), (64, 8)]:
            dm.BLOCK_N, dm.NUM_WARPS = block_n, warps
            t = cuda_time(functools.partial(dm.paged_decode_attention, q, k, v, tables,
                                            kv_lens, 0.1, max_kv_len=ctx))
            if (block_n, warps) == (64, 4):
                default_t = t
            if best is None or t < best[0]:
                best = (t, block_n, warps)
        dm.BLOCK_N, dm.NUM_WARPS = 64, 4
        splits = dm.choose_num_splits(batch, hkv, ctx, torch.cuda.get_device_properties(0)
                                      .multi_processor_count)
        frac = nbytes / default_t / results.get("copy", math.nan)
        row("decode", f"{label} page{page} (splits={splits}) GB/s", nbytes / default_t / 1e9,
            ">= 70% of copy", frac >= 0.7, fraction_of_copy=frac, us=default_t * 1e6)
        row("decode", f"{label} page{page} best (BLOCK_N, warps)",
            f"{best[1]},{best[2]}: {nbytes / best[0] / 1e9:.0f} GB/s "
            f"({nbytes / best[0] / results.get('copy', math.nan):.0%})")
        del k, v


def cascade_decode_step(groups: int, per_group: int, prefix: int, suffix: int, page: int,
                        hkv: int, group: int, d: int, dtype: torch.dtype,
                        device: torch.device | str, gen: torch.Generator) -> dict[str, Any]:
    """A decode step of `groups x per_group` sequences: each group's `prefix` tokens sit in
    shared blocks as a radix cache holds them (its whole blocks; the partial last one is
    each member's own copy), then `suffix` private tokens, the last one new. Returns the
    metadata with and without the cascade plan, one layer's caches, q/k/v and the bytes
    of KV each way reads."""
    from radixserve.worker.attention.base import AttentionMetadata
    from radixserve.worker.cascade import CascadeOptions, plan_cascade

    shared = prefix // page
    own = prefix - shared * page + suffix
    own_blocks = -(-own // page)
    batch = groups * per_group
    num_blocks = groups * shared + batch * own_blocks + 1
    perm = torch.randperm(num_blocks, generator=gen, device=gen.device).tolist()
    tables = []
    for _ in range(groups):
        run = [perm.pop() for _ in range(shared)]
        tables += [run + [perm.pop() for _ in range(own_blocks)] for _ in range(per_group)]
    kv_len = shared * page + own
    kv_lens, q_lens = [kv_len] * batch, [1] * batch
    # Every group gets its pass whatever the (CPU-tuned) gates say: the pass is timed here.
    plan = plan_cascade(tables, kv_lens, q_lens, page, CascadeOptions(3, 1, 2))
    slots = [t[(kv_len - 1) // page] * page + (kv_len - 1) % page for t in tables]
    meta = AttentionMetadata(
        q_start=torch.arange(batch + 1, dtype=torch.int32, device=device),
        q_lens=torch.ones(batch, dtype=torch.int32, device=device),
        kv_lens=torch.full((batch,), kv_len, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        max_q_len=1, max_kv_len=kv_len, page_size=page, cascade=plan)
    shape = (num_blocks, page, hkv, d)
    kv_token = hkv * d * 2 * torch.empty((), dtype=dtype).element_size()  # K and V
    return dict(
        cascade=meta, plain=dataclasses.replace(meta, cascade=None),
        k_cache=torch.randn(shape, generator=gen, device=device).to(dtype),
        v_cache=torch.randn(shape, generator=gen, device=device).to(dtype),
        q=torch.randn(batch, hkv * group, d, generator=gen, device=device).to(dtype),
        k=torch.randn(batch, hkv, d, generator=gen, device=device).to(dtype),
        v=torch.randn(batch, hkv, d, generator=gen, device=device).to(dtype),
        plain_bytes=batch * kv_len * kv_token,
        cascade_bytes=(groups * shared * page + batch * own) * kv_token,
        levels=0 if plan is None else len(plan.levels))


def section_cascade(results: dict[str, float]) -> None:
    from radixserve.kernels import cascade_attention as cm
    from radixserve.worker.attention.triton_backend import TritonAttentionBackend

    gen = torch.Generator(device="cuda").manual_seed(4)
    copy_bw = results.get("copy", math.nan)
    for label, (hkv, group, d), (groups, per_group), sweep in [
            ("smollm2 9/3x64", (3, 3, 64), (8, 8), False),
            ("llama8b 32/8x128", (8, 4, 128), (8, 8), True),
            ("llama8b 32/8x128", (8, 4, 128), (1, 64), False)]:
        step = cascade_decode_step(groups, per_group, 1000, 64, 16, hkv, group, d,
                                   torch.bfloat16, "cuda", gen)
        assert step["levels"] == 1, "the planner found no shared runs"
        q, k, v, kc, vc = (step[n] for n in ("q", "k", "v", "k_cache", "v_cache"))
        name = f"{label} {groups}x{per_group}"
        backends = {}
        for mode in ("plain", "cascade"):
            backend = TritonAttentionBackend()
            backend.begin_forward(step[mode])  # warm (first-call costs), then timed
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            backend.begin_forward(step[mode])
            torch.cuda.synchronize()
            backends[mode] = (backend, time.perf_counter() - t0)
        outs = {m: b.forward(q, k, v, kc, vc, d ** -0.5) for m, (b, _) in backends.items()}
        times = {m: cuda_time(lambda b=b: b.forward(q, k, v, kc, vc, d ** -0.5))
                 for m, (b, _) in backends.items()}
        err = rel(outs["cascade"], outs["plain"])
        row("cascade", f"{name} cascade vs plain max rel err", err, "<= 1e-2", err <= 1e-2)
        t_plain, t_casc = times["plain"], times["cascade"]
        row("cascade", f"{name} plain GB/s (KV read)", step["plain_bytes"] / t_plain / 1e9,
            us=t_plain * 1e6, fraction_of_copy=step["plain_bytes"] / t_plain / copy_bw)
        row("cascade", f"{name} cascade GB/s (KV read)", step["cascade_bytes"] / t_casc / 1e9,
            us=t_casc * 1e6, fraction_of_copy=step["cascade_bytes"] / t_casc / copy_bw)
        row("cascade", f"{name} cascade effective GB/s (plain bytes)",
            step["plain_bytes"] / t_casc / 1e9)
        row("cascade", f"{name} us/layer plain -> cascade",
            f"{t_plain * 1e6:.1f} -> {t_casc * 1e6:.1f}")
        row("cascade", f"{name} speedup plain/cascade", t_plain / t_casc, "> 1",
            t_plain / t_casc > 1, kv_bytes_ratio=step["plain_bytes"] / step["cascade_bytes"])
        row("cascade", f"{name} begin_forward ms/step plain, cascade",
            f"{backends['plain'][1] * 1e3:.2f}, {backends['cascade'][1] * 1e3:.2f}")
        if sweep:
            backend, default = backends["cascade"][0], (cm.MIN_SPLIT_TOKENS, cm.NUM_WARPS)
            found = {}
            try:
                for knobs in [default, (10**9, 4), (128, 4), (512, 4), (default[0], 8)]:
                    cm.MIN_SPLIT_TOKENS, cm.NUM_WARPS = knobs
                    found[knobs] = cuda_time(lambda: backend.forward(q, k, v, kc, vc, d ** -0.5))
            finally:
                cm.MIN_SPLIT_TOKENS, cm.NUM_WARPS = default
            best = min(found, key=found.get)
            row("cascade", f"{name} best (MIN_SPLIT_TOKENS, warps)",
                f"{best}: {found[best] * 1e6:.0f} us (default {found[default] * 1e6:.0f})",
                sweep={str(key): t * 1e6 for key, t in found.items()})
        del step, backends, outs


def flash_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any,
               scale: float) -> torch.Tensor:
    """torch's SDPA through its flash kernel (causal where `mask` is None)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)


def section_extend() -> None:
    from torch.nn.attention.bias import causal_lower_right

    from radixserve.kernels import extend_attention as em

    gen = torch.Generator(device="cuda").manual_seed(2)
    for label, (hkv, group, d) in [("smollm2 9/3x64", (3, 3, 64)),
                                   ("llama8b 32/8x128", (8, 4, 128))]:
        for batch, q_len, prefix in [(4, 2048, 0), (4, 512, 3584)]:
            kv = q_len + prefix
            k, v, tables, kv_lens = paged([kv] * batch, 16, hkv, d, torch.bfloat16, gen)
            h = hkv * group
            q = torch.randn(batch * q_len, h, d, device="cuda").to(torch.bfloat16)
            q_start = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * q_len
            # the same data, contiguous, heads expanded for SDPA: [B, H, L, D]
            kc = k[tables.long()].flatten(1, 2)[:, :kv].transpose(1, 2)
            vc = v[tables.long()].flatten(1, 2)[:, :kv].transpose(1, 2)
            kc = kc.repeat_interleave(group, 1).contiguous()
            vc = vc.repeat_interleave(group, 1).contiguous()
            qc = q.view(batch, q_len, h, d).transpose(1, 2).contiguous()
            mask = causal_lower_right(q_len, kv) if prefix else None

            sdpa = functools.partial(flash_sdpa, qc, kc, vc, mask, d ** -0.5)
            t_sdpa = cuda_time(sdpa)
            ref = sdpa().transpose(1, 2).reshape_as(q)
            times = {}
            for cfg in [None, (64, 64, 4, 2), (128, 64, 8, 3), (128, 32, 4, 3),
                        (64, 32, 4, 3), (128, 128, 8, 2)]:
                em.CONFIG_OVERRIDE = cfg
                try:
                    times[cfg] = cuda_time(functools.partial(
                        em.extend_attention, q, k, v, tables, q_start, kv_lens, d ** -0.5,
                        max_q_len=q_len))
                except Exception as exc:  # noqa: BLE001 - a config may not fit
                    print(f"  extend config {cfg} failed: {type(exc).__name__}")
            em.CONFIG_OVERRIDE = None
            out = em.extend_attention(q, k, v, tables, q_start, kv_lens, d ** -0.5,
                                      max_q_len=q_len)
            ratio = times[None] / t_sdpa
            name = f"{label} B{batch} q{q_len} prefix{prefix}"
            row("extend", f"{name} triton/sdpa", ratio, "<= 1.3", ratio <= 1.3,
                triton_us=times[None] * 1e6, sdpa_us=t_sdpa * 1e6, rel_err=rel(out, ref))
            best = min(times, key=times.get)
            row("extend", f"{name} best config (BM,BN,warps,stages)",
                f"{best}: {times[best] / t_sdpa:.2f}x")
            del k, v, kc, vc, sdpa


def decode_over_views(layout: str, page: int, batch: int, ctx: int, hkv: int, d: int,
                      dtype: torch.dtype) -> None:
    """One layer's decode over the views of a `layout` pool against the paged read of the
    same blocks, the mapping cost per block, and the views unmapped after a release."""
    from radixserve.kernels.decode_attention import paged_decode_attention
    from radixserve.worker.virtual_kv_cuda import CudaVirtualKVPool

    blocks_per_seq = -(-ctx // page)
    pool = CudaVirtualKVPool(30, batch * blocks_per_seq + 1, page, hkv, d, dtype,
                             num_slots=batch, slot_blocks=blocks_per_seq,
                             device=torch.device("cuda"), page_layout=layout)
    perm = torch.randperm(pool.num_blocks)[:batch * blocks_per_seq].tolist()
    tables = [perm[i * blocks_per_seq:(i + 1) * blocks_per_seq] for i in range(batch)]
    kv_lens = [ctx] * batch
    t0 = time.perf_counter()
    slots = pool.prepare(tables, kv_lens, [1] * batch, [])
    torch.cuda.synchronize()
    map_us = (time.perf_counter() - t0) / (batch * blocks_per_seq) * 1e6
    pool.buffer.normal_()
    q = torch.randn(batch, hkv * 3, d, device="cuda", dtype=dtype)
    lens = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
    k_view, v_view = pool.layers[0]
    view_tables = pool.view_tables(slots, blocks_per_seq).cuda()
    k_phys, v_phys = pool.physical[0]
    paged_tables = torch.tensor(tables, dtype=torch.int32, device="cuda")
    virt = functools.partial(paged_decode_attention, q, k_view, v_view, view_tables,
                             lens, 0.125, max_kv_len=ctx, contiguous=True)
    pag = functools.partial(paged_decode_attention, q, k_phys, v_phys, paged_tables, lens,
                            0.125, max_kv_len=ctx)
    agree = rel(virt().float(), pag().float())
    t_virt, t_pag = cuda_time(virt), cuda_time(pag)
    name = f"{layout} page {page}, batch {batch} x {ctx}"
    row("virtual", f"{name}: decode paged/virtual time", t_pag / t_virt, ">= 0.95",
        t_pag / t_virt >= 0.95, paged_us=t_pag * 1e6, virtual_us=t_virt * 1e6,
        rel_err=agree, map_us_per_block=map_us, handles_per_block=pool.regions)
    pool.release_all()
    row("virtual", f"{name}: mappings after release", pool.mapping_count(), "1",
        pool.mapping_count() == 1)


def section_virtual() -> None:
    import radixserve

    hkv, d, ctx, dtype = 3, 64, 2048, torch.bfloat16  # the default model's shape
    # Its two page layouts: 91-token blocks of all 30 layers in a 2 MiB page, or a 2 MiB
    # page per layer's K or V (5,461 tokens: one block a sequence here).
    for layout, page in (("block", 91), ("layer", 5461)):
        for batch in (8, 32, 64):
            decode_over_views(layout, page, batch, ctx, hkv, d, dtype)
    prefix = "You are a careful assistant. " + " ".join(
        f"Fact {i}: item {i} costs {i * 7 % 101} coins." for i in range(60))
    prompts = [prefix + f" Question: how many coins does item {i} cost?" for i in range(16)]
    params = {"max_new_tokens": 32, "temperature": 0.0}
    outs = {}
    for layout in ("paged", "virtual"):
        engine = radixserve.Engine(model="smollm2-135m", device="cuda", dtype="bfloat16",
                                   attention_backend="triton", kv_layout=layout, page_size=91,
                                   max_running_requests=32, max_total_tokens=200_000)
        try:
            engine.generate(prompt=prompts[:1], sampling_params=params)
            t0 = time.perf_counter()
            outs[layout] = [r["output_ids"] for r in
                            engine.generate(prompt=prompts, sampling_params=params)]
            wall = time.perf_counter() - t0
            engine.flush_cache()
            if layout == "virtual":
                pool = engine.worker.pool
                row("virtual", "engine: mappings after flush", pool.mapping_count(), "1",
                    pool.mapping_count() == 1)
                row("virtual", "engine: steps that waited for a mapping", pool.stats.map_waits,
                    "counted", None, wait_s=pool.stats.map_wait_seconds,
                    mapped_ahead=pool.stats.mapped_ahead, blocks_mapped=pool.stats.blocks_mapped)
            row("virtual", f"engine {layout}: 16 requests wall s", wall)
        finally:
            engine.shutdown()
    same = sum(a == b for a, b in zip(outs["paged"], outs["virtual"]))
    row("virtual", "greedy outputs identical virtual vs paged (bf16)", f"{same}/16", "16/16",
        same == 16)


def section_e2e(args: argparse.Namespace) -> None:
    import radixserve

    torch.cuda.empty_cache()
    prefix = ("You are a careful assistant. Use the facts below.\n" + " ".join(
        f"Fact {i}: item {i} costs {i * 7 % 101} coins." for i in range(120)) + "\n")
    prompts = [prefix + f"Question: how many coins does item {i} cost?" for i in range(33)]
    params = {"max_new_tokens": 64, "temperature": 0.0}
    outs: dict[str, list[dict[str, Any]]] = {}
    for backend in ("triton", "torch"):
        if backend == "torch" and time.perf_counter() - T0 > args.budget_s - 60:
            break
        t0 = time.perf_counter()
        engine = radixserve.Engine(model="smollm2-135m", device="cuda", dtype="bfloat16",
                                   attention_backend=backend)
        try:
            load_s = time.perf_counter() - t0
            batch = prompts if backend == "triton" else prompts[:9]
            engine.generate(prompt=[batch[0]], sampling_params=params)  # warm + cache prefix
            t1 = time.perf_counter()
            res = engine.generate(prompt=batch[1:], sampling_params=params)
            wall = time.perf_counter() - t1
        finally:
            getattr(engine, "shutdown", lambda: None)()
        res = [res] if isinstance(res, dict) else list(res)
        outs[backend] = res
        cached = sum(r["meta_info"]["cached_tokens"] for r in res)
        prompt_toks = sum(r["meta_info"]["prompt_tokens"] for r in res)
        gen_toks = sum(r["meta_info"]["completion_tokens"] for r in res)
        row("e2e", f"{backend}: cached/prompt tokens", cached / max(prompt_toks, 1),
            "> 0.8", cached / max(prompt_toks, 1) > 0.8, load_s=load_s, wall_s=wall)
        row("e2e", f"{backend}: {len(res)} requests, output tok/s", gen_toks / wall,
            sample=res[0].get("text", "")[:120])
    if "torch" in outs:
        n = len(outs["torch"])
        same = sum(a["output_ids"] == b["output_ids"]
                   for a, b in zip(outs["triton"][:n], outs["torch"]))
        row("e2e", "greedy outputs identical triton vs torch (bf16)", f"{same}/{n}")


def tp_model() -> tuple[str, str]:
    """A model two ranks can split, and why it is that one: the default model where its
    heads divide by 2, else `bench/tp.py`'s random one (the default's 9 do not)."""
    from bench import tp
    from radixserve.config import DEFAULT_MODEL
    from radixserve.model.config import ModelConfig
    from radixserve.model.loader import resolve_model
    from radixserve.model.shards import ModelShards

    try:
        ModelShards.of(ModelConfig.from_dir(resolve_model(DEFAULT_MODEL)), 0, 2)
        return DEFAULT_MODEL, "the default model"
    except ValueError as e:
        shape = tp.PRESETS["quick"]["shape"]
        return str(tp.model_dir(tp.TINY, shape)), f"random {shape} ({e})"


def section_tp() -> None:
    """`Engine(tp_size=2)` (a rank a GPU, NCCL between them) against `tp_size=1`:
    greedy outputs in float32 (where only the partial sums' order differs), and the
    median decode step of batch 64 x 256-token contexts through rank 0's worker."""
    count = torch.cuda.device_count()
    if count < 2:
        row("tp", "skipped", f"tp_size=2 needs 2 CUDA devices; torch sees {count}")
        return
    import radixserve
    from bench.tp import step_batch

    model, why = tp_model()
    row("tp", "model", model, reason=why)
    prompts = [f"Question {i}: what comes after {i * 13 % 97}? Answer:" for i in range(8)]
    params = {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}
    fb = step_batch(64, 256)
    outs, step_ms = {}, {}
    for tp_size in (1, 2):
        engine = radixserve.Engine(model=model, device="cuda", dtype="float32",
                                   tp_size=tp_size, max_total_tokens=100_000)
        try:
            outs[tp_size] = [r["output_ids"] for r in
                             engine.generate(prompt=prompts, sampling_params=params)]
            engine.flush_cache()  # the steps below write over blocks the cache held
            times = []
            for _ in range(12):
                t0 = time.perf_counter()
                engine.worker.forward(fb)  # returns sampled tokens: the step has finished
                times.append(time.perf_counter() - t0)
            step_ms[tp_size] = statistics.median(times[2:]) * 1e3
        finally:
            engine.shutdown()
        row("tp", f"tp_size={tp_size}: decode step batch 64 x 256 ms", step_ms[tp_size])
    same = sum(a == b for a, b in zip(outs[1], outs[2]))
    row("tp", "greedy outputs identical tp_size=2 vs 1 (fp32)", f"{same}/{len(prompts)}",
        f"{len(prompts)}/{len(prompts)}", same == len(prompts))
    row("tp", "decode step tp_size=2 / tp_size=1", step_ms[2] / step_ms[1])


def section_quantization() -> None:
    """`--quantization int8|q4` has no CUDA kernels wired: a refusal at start-up, before
    the weights load (seconds, not a model load)."""
    import radixserve

    for method in ("int8", "q4"):
        t0 = time.perf_counter()
        try:
            radixserve.Engine(model="smollm2-135m", device="cuda", quantization=method).shutdown()
            refused = "started"
        except ValueError as e:
            refused = str(e)
        ok = "weight-only CPU kernels" in refused
        row("quant", f"{method} on CUDA refused at start-up", ok, "True", ok,
            seconds=time.perf_counter() - t0, message=refused[:200])


def main() -> None:
    parser = argparse.ArgumentParser(description="GPU check of the Triton attention path")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="skip sections that would start after this many seconds")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    import triton
    row("env", "device", torch.cuda.get_device_name(0),
        torch=torch.__version__, triton=triton.__version__)
    results: dict[str, float] = {}
    sections = [("correctness", section_correctness), ("bandwidth", lambda: section_bandwidth(
        results)), ("decode", lambda: section_decode(results)),
        ("cascade", lambda: section_cascade(results)), ("extend", section_extend),
        ("virtual", section_virtual), ("quant", section_quantization), ("tp", section_tp),
        ("e2e", lambda: section_e2e(args))]
    for name, fn in sections:
        if time.perf_counter() - T0 > args.budget_s - (120 if name == "e2e" else 30):
            row(name, "skipped", "out of time budget", ok=False)
            continue
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - one failure must not hide the rest
            traceback.print_exc()
            row(name, "FAILED", f"{type(exc).__name__}: {str(exc)[:300]}", ok=False)
        torch.cuda.empty_cache()
    print(f"\n{'section':<12} {'check':<58} {'value':<28} {'target':<16} ok")
    for r in ROWS:
        value = f"{r['value']:.4g}" if isinstance(r["value"], float) else str(r["value"])
        ok = "" if r["ok"] is None else ("PASS" if r["ok"] else "FAIL")
        print(f"{r['section']:<12} {r['name'][:58]:<58} {value[:28]:<28} {r['target']:<16} {ok}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump({"rows": ROWS, "total_s": time.perf_counter() - T0}, f, indent=1, default=str)
    print(f"total {time.perf_counter() - T0:.0f}s; json in {args.out}/gpu_check.json")


if __name__ == "__main__":
    main()
