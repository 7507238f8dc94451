"""Paged decode attention in Triton: one query token per sequence against its paged KV.

Design. One program per (sequence, KV head, split). The program loads the `GROUP` query
heads that share its KV head as one `[BLOCK_G, D]` tile (GQA packing, padded to 16 rows
for `tl.dot`), so each K/V tile is read from memory once per KV head, not once per query
head. It walks its token range in tiles of `BLOCK_N` tokens; each token's physical
address is `block_tables[b, tok // page_size] * stride_block + (tok % page_size) *
stride_page`, so any page size (1, 16, 64, ...) works with the same code. Online softmax
in fp32 (base 2), fp32 accumulator whatever the input dtype.

Split-KV (flash-decoding): when the batch alone cannot fill the GPU and contexts are long,
each sequence's tokens are cut into `num_splits` equal ranges; pass 1 writes each range's
normalised partial output and its log-sum-exp to an fp32 workspace, pass 2 merges them
with weights `exp2(lse_s - max lse)` (numerically stable). Ranges that start past a
sequence's length are never written and never read.

With `return_lse` (the own parts of tree attention, merged afterwards with the shared-run
partials) the output is fp32 and the natural log-sum-exp of each query head is written
too: by the one pass directly, or by the merge pass from the splits' base-2 ones.

Sliding window (`window`): a sequence's query reads only its last `window` keys, so its
token range starts at `max(0, kv_len - window)` instead of 0 and the splits cut that range;
the tokens before it are never read.
"""

from __future__ import annotations

import math
from typing import Literal, overload

import torch
import triton
import triton.language as tl

from radixserve.kernels._common import (LN2, LOG2E, block_d, check_paged, kernel_outputs,
                                        dot_precision, paged_softmax_pass)

BLOCK_N = 64
"""KV tokens per inner-loop tile."""
MIN_SPLIT_TOKENS = 512
"""A split covers at least this many tokens: shorter ranges cost more to merge than they save."""
MAX_SPLITS = 16
NO_WINDOW = 2 ** 30
"""The `window` the kernels get for full attention: wider than any context."""
NUM_WARPS = 4
NUM_STAGES = 2
"""Launch knobs (module-level so that bench/gpu/ can sweep them)."""


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, kv_lens_ptr, o_ptr, lse_ptr,
                   stride_qb, stride_qh, stride_kb, stride_kp, stride_kh,
                   stride_vb, stride_vp, stride_vh, stride_btb, stride_btn,
                   stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                   qk_scale, split_len, window,
                   GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   PRECISION: tl.constexpr, SPLIT: tl.constexpr, WRITE_LSE: tl.constexpr,
                   CONTIGUOUS: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(kv_lens_ptr + b)
    start = tl.maximum(kv_len - window, 0) + split * split_len
    if start >= kv_len:
        return
    end = tl.minimum(kv_len, start + split_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    gd_mask = (offs_g[:, None] < GROUP) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
                + offs_d[None, :], mask=gd_mask, other=0.0)

    m_i, l_i, acc = paged_softmax_pass(
        q, bt_ptr + b.to(tl.int64) * stride_btb, stride_btn, start, end, k_ptr, v_ptr,
        kv_head, stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh, qk_scale,
        BLOCK_G, PAGE_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D, PRECISION, CONTIGUOUS)

    out = acc / l_i[:, None]
    o_off = b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    if SPLIT:
        tl.store(o_ptr + o_off + split * stride_os, out, mask=gd_mask)
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, m_i + tl.log2(l_i),
                 mask=offs_g < GROUP)
    else:
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=gd_mask)
        if WRITE_LSE:  # the final natural log-sum-exp, [batch, num_heads]
            tl.store(lse_ptr + b * stride_lb + heads * stride_lh,
                     (m_i + tl.log2(l_i)) * LN2, mask=offs_g < GROUP)


@triton.jit
def _merge_kernel(mid_ptr, lse_ptr, kv_lens_ptr, o_ptr, lse_out_ptr,
                  stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
                  stride_lob, stride_loh, split_len, window,
                  HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                  WRITE_LSE: tl.constexpr):
    b = tl.program_id(0)
    head = tl.program_id(1)
    kv_len = tl.load(kv_lens_ptr + b)
    num_valid = tl.cdiv(kv_len - tl.maximum(kv_len - window, 0), split_len)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_valid
    lse = tl.load(lse_ptr + b * stride_lb + head * stride_lh + offs_s, mask=s_mask,
                  other=float("-inf"))
    lse_max = tl.max(lse, 0)
    w = tl.exp2(lse - lse_max)
    w = tl.where(s_mask, w, 0.0)
    mid = tl.load(mid_ptr + b.to(tl.int64) * stride_mb + head * stride_mh
                  + offs_s[:, None] * stride_ms + offs_d[None, :],
                  mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    w_sum = tl.sum(w, 0)
    out = tl.sum(mid * w[:, None], 0) / w_sum
    tl.store(o_ptr + b.to(tl.int64) * stride_ob + head * stride_oh + offs_d,
             out.to(o_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
    if WRITE_LSE:
        tl.store(lse_out_ptr + b * stride_lob + head * stride_loh,
                 (lse_max + tl.log2(w_sum)) * LN2)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # an H100/H200; only shapes the heuristic on the CPU


def choose_num_splits(batch: int, num_kv_heads: int, max_kv_len: int, num_sms: int) -> int:
    """Split only when (batch x KV heads) programs fill less than two waves of SMs, and
    never cut a range below `MIN_SPLIT_TOKENS` tokens."""
    programs = batch * num_kv_heads
    if programs >= 2 * num_sms or max_kv_len < 2 * MIN_SPLIT_TOKENS:
        return 1
    want = math.ceil(2 * num_sms / programs)
    return max(1, min(want, max_kv_len // MIN_SPLIT_TOKENS, MAX_SPLITS))


def _workspace(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """fp32 scratch for the split path (a seam for tests, which poison it)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


@overload
def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, kv_lens: torch.Tensor, scale: float, *,
                           max_kv_len: int | None = ..., num_splits: int | None = ...,
                           out: torch.Tensor | None = ..., return_lse: Literal[False] = ...,
                           lse_out: torch.Tensor | None = ..., window: int | None = ...,
                           contiguous: bool = ...) -> torch.Tensor: ...
@overload
def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, kv_lens: torch.Tensor, scale: float, *,
                           max_kv_len: int | None = ..., num_splits: int | None = ...,
                           out: torch.Tensor | None = ..., return_lse: Literal[True],
                           lse_out: torch.Tensor | None = ..., window: int | None = ...,
                           contiguous: bool = ...) -> tuple[torch.Tensor, torch.Tensor]: ...


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, kv_lens: torch.Tensor,
                           scale: float, *, max_kv_len: int | None = None,
                           num_splits: int | None = None,
                           out: torch.Tensor | None = None, return_lse: bool = False,
                           lse_out: torch.Tensor | None = None,
                           window: int | None = None, contiguous: bool = False,
                           ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `paged_torch.paged_decode_attention` (same contract and layout).

    Keyword-only extras: `max_kv_len` (an upper bound on `kv_lens`; when omitted,
    `block_tables.shape[1] * page_size` is used, which needs no device sync),
    `num_splits` (force the split count; default from `choose_num_splits`), `out`
    (a `[batch, num_heads, head_dim]` tensor to write into). Every `kv_lens[b]` must be
    >= 1 and `block_tables[b]` must list its first `ceil(kv_lens[b] / page_size)` blocks;
    entries past those are never read. `return_lse`: return the fp32 output and its
    natural log-sum-exp `[batch, num_heads]` (like the reference); `out` must then be
    float32, and `lse_out` (fp32 `[batch, num_heads]`) is where the log-sum-exp goes.
    `window`: a sliding window (each query reads its last `window` keys), or None.
    `contiguous`: each row of `block_tables` is consecutive block ids over caches whose
    blocks lie back to back (the virtual layout), so only its first entry is read.
    """
    group, page_size = check_paged(q, k_cache, v_cache, block_tables)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    out, lse_out = kernel_outputs(q, out, lse_out, (batch, num_heads, head_dim), return_lse)
    result = out if lse_out is None else (out, lse_out)
    if batch == 0:
        return result
    if max_kv_len is None:
        max_kv_len = block_tables.shape[1] * page_size
    if window is not None:  # each range is at most window tokens long
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        max_kv_len = min(max_kv_len, window)
    window_arg = NO_WINDOW if window is None else window
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_kv_len, _num_sms(q.device))
    num_splits = max(1, min(num_splits, triton.cdiv(max_kv_len, BLOCK_N)))
    split_len = triton.cdiv(triton.cdiv(max_kv_len, num_splits), BLOCK_N) * BLOCK_N
    common = dict(GROUP=group, PAGE_SIZE=page_size, HEAD_DIM=head_dim,
                  BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=BLOCK_N,
                  BLOCK_D=block_d(head_dim), PRECISION=dot_precision(q.dtype),
                  CONTIGUOUS=contiguous, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    args = (q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
            block_tables.stride(0), block_tables.stride(1))
    grid = (batch, num_kv_heads, num_splits)
    if num_splits == 1:
        lse_args = ((lse_out, lse_out.stride(0), lse_out.stride(1)) if lse_out is not None
                    else (out, 0, 0))
        _decode_kernel[grid](q, k_cache, v_cache, block_tables, kv_lens, out, lse_args[0],
                             *args, out.stride(0), out.stride(1), 0, *lse_args[1:],
                             scale * LOG2E, split_len, window_arg, SPLIT=False,
                             WRITE_LSE=return_lse,
                             **common)
        return result
    mid = _workspace((batch, num_heads, num_splits, head_dim), q.device)
    lse = _workspace((batch, num_heads, num_splits), q.device)
    _decode_kernel[grid](q, k_cache, v_cache, block_tables, kv_lens, mid, lse, *args,
                         mid.stride(0), mid.stride(1), mid.stride(2), lse.stride(0),
                         lse.stride(1), scale * LOG2E, split_len, window_arg, SPLIT=True,
                         WRITE_LSE=False, **common)
    lse_final = lse if lse_out is None else lse_out
    _merge_kernel[(batch, num_heads)](
        mid, lse, kv_lens, out, lse_final, mid.stride(0), mid.stride(1), mid.stride(2),
        lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
        lse_final.stride(0) if return_lse else 0, lse_final.stride(1) if return_lse else 0,
        split_len, window_arg, HEAD_DIM=head_dim,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        BLOCK_D=block_d(head_dim), WRITE_LSE=return_lse, num_warps=4)
    return result
