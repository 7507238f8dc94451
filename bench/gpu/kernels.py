"""The Triton kernels timed on a GPU (bench/gpu/run.py's kernel sections): the copy
bandwidth, paged decode, tree (cascade) attention and extend against torch's flash SDPA.
Their agreement with the torch references is tests/gpu/test_kernels_bf16.py's."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any

import torch

from bench.gpu.timing import cuda_time, paged, rel, row


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
        times = {m: cuda_time(lambda b=b: b.forward(q, k, v, kc, vc, d ** -0.5))  # noqa: B023
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
                    found[knobs] = cuda_time(lambda: backend.forward(q, k, v, kc, vc, d ** -0.5))  # noqa: B023
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
    from radixserve.kernels import extend_attention as em
    from torch.nn.attention.bias import causal_lower_right

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
