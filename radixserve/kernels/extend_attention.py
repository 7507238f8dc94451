"""Extend (prefill-chunk) attention over the paged KV cache in Triton.

The new tokens of each sequence are already stored in the cache (the backend stores K/V
first), so a query at position `p` attends to cache tokens `0..p` of its sequence: the
cached prefix and, causally, its own chunk, in one loop over the paged cache.

Design. Grid `(cdiv(max_q_len, BLOCK_M), num_heads, batch)`: one program per tile of
`BLOCK_M` queries of one sequence and one query head (its KV head is `head // group`).
Sequence b's queries sit at `q_start[b]..q_start[b+1]` in the packed token axis and at
positions `prefix + i` with `prefix = kv_lens[b] - q_len_b`. The key loop has two phases:
tiles entirely below the tile's first query position need no causal mask (the whole cached
prefix, and the chunk's earlier tokens); the last few tiles, which cross the diagonal,
apply `key <= position`. Tiles past the last query are skipped, not masked. Online softmax
in fp32 and base 2; fp32 accumulator whatever the input dtype. Tiles of the grid beyond a
short sequence's length return at once. With `return_lse` the output is fp32 and each
query head's natural log-sum-exp is written beside it (for the merge of tree attention).

Sliding window (`window`, a `SLIDING` specialisation): a query at position p reads keys
p-window+1 .. p. The key loop then starts at the tile holding the first row's first key
and masks every tile (causal and window), so keys before the window are never read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.kernels._common import (LN2, LOG2E, block_d, check_paged, kernel_outputs,
                                        dot_precision, token_blocks)


@triton.jit
def _attend_tile(acc, m_i, l_i, q, k_ptr, v_ptr, bt_row, stride_btn, first, kv_off, n0,
                 stride_kb, stride_kp, stride_vb, stride_vp, qk_scale, kv_len, rows,
                 offs_n, offs_d, d_mask, window,
                 PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr,
                 SLIDING: tl.constexpr, CONTIGUOUS: tl.constexpr):
    """One `BLOCK_N` tile of keys: update the online-softmax state `(acc, m_i, l_i)`."""
    toks = n0 + offs_n
    n_mask = toks < kv_len if MASKED else toks >= 0
    blk = token_blocks(bt_row, stride_btn, first, toks, n_mask, PAGE_SIZE, CONTIGUOUS, MASKED)
    page_off = toks % PAGE_SIZE
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k_off = blk * stride_kb + page_off * stride_kp + kv_off
    k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, N]
    if MASKED:
        visible = (toks[None, :] <= rows[:, None]) & n_mask[None, :]
        if SLIDING:
            visible = visible & (toks[None, :] > rows[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v_off = blk * stride_vb + page_off * stride_vp + kv_off
    v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _extend_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, q_start_ptr, q_lens_ptr, kv_lens_ptr, o_ptr,
                   lse_ptr, stride_qt, stride_qh, stride_kb, stride_kp, stride_kh,
                   stride_vb, stride_vp, stride_vh, stride_btb, stride_btn,
                   stride_ot, stride_oh, stride_lt, stride_lh, qk_scale, window,
                   GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   PRECISION: tl.constexpr, HAS_Q_LENS: tl.constexpr,
                   WRITE_LSE: tl.constexpr, SLIDING: tl.constexpr, CONTIGUOUS: tl.constexpr):
    # Heaviest tiles (last queries: most keys) first; the query heads of one KV head are
    # neighbours in launch order, so their shared K/V tiles meet in L2.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)
    q_lo = tl.load(q_start_ptr + b)
    if HAS_Q_LENS:
        q_len = tl.load(q_lens_ptr + b)
    else:
        q_len = tl.load(q_start_ptr + b + 1) - q_lo
    m_start = pid_m * BLOCK_M
    if m_start >= q_len:
        return
    kv_len = tl.load(kv_lens_ptr + b)
    prefix = kv_len - q_len

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_mask = offs_m < q_len
    tok = (q_lo + offs_m).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    rows = prefix + offs_m  # each query's position = the last key it may see

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    kv_head = head // GROUP
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    first = tl.load(bt_row).to(tl.int64) if CONTIGUOUS else 0
    diag_end = tl.minimum(kv_len, prefix + m_start + BLOCK_M)
    if SLIDING:
        # From the tile holding the first row's first key, every tile masked.
        lo = tl.maximum(prefix + m_start - window + 1, 0) // BLOCK_N * BLOCK_N
        for n0 in range(lo, diag_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, k_ptr, v_ptr, bt_row, stride_btn, first,
                kv_head * stride_kh, n0, stride_kb, stride_kp, stride_vb, stride_vp, qk_scale,
                kv_len, rows, offs_n, offs_d, d_mask, window, PAGE_SIZE=PAGE_SIZE, MASKED=True,
                PRECISION=PRECISION, SLIDING=True, CONTIGUOUS=CONTIGUOUS)
    else:
        # Phase 1: keys below the tile's first position: visible to every row, all < kv_len.
        full_end = (prefix + m_start) // BLOCK_N * BLOCK_N
        for n0 in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, k_ptr, v_ptr, bt_row, stride_btn, first,
                kv_head * stride_kh, n0, stride_kb, stride_kp, stride_vb, stride_vp, qk_scale,
                kv_len, rows, offs_n, offs_d, d_mask, window, PAGE_SIZE=PAGE_SIZE, MASKED=False,
                PRECISION=PRECISION, SLIDING=False, CONTIGUOUS=CONTIGUOUS)
        # Phase 2: the tiles that cross the causal diagonal (and the sequence's end).
        for n0 in range(full_end, diag_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, k_ptr, v_ptr, bt_row, stride_btn, first,
                kv_head * stride_kh, n0, stride_kb, stride_kp, stride_vb, stride_vp, qk_scale,
                kv_len, rows, offs_n, offs_d, d_mask, window, PAGE_SIZE=PAGE_SIZE, MASKED=True,
                PRECISION=PRECISION, SLIDING=False, CONTIGUOUS=CONTIGUOUS)

    out = acc / l_i[:, None]
    tl.store(o_ptr + tok[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])
    if WRITE_LSE:
        tl.store(lse_ptr + tok * stride_lt + head * stride_lh, (m_i + tl.log2(l_i)) * LN2,
                 mask=m_mask)


CONFIG_OVERRIDE: tuple[int, int, int, int] | None = None
"""`(BLOCK_M, BLOCK_N, num_warps, num_stages)` forced for every launch (bench sweeps)."""


def launch_config(max_q_len: int, head_dim: int, elem_size: int) -> tuple[int, int, int, int]:
    """`(BLOCK_M, BLOCK_N, num_warps, num_stages)`: small query tiles for short chunks
    (decode rows in a mixed batch), 128x64 tiles for long ones when half-precision K/V
    stages fit in shared memory (untuned: a common FlashAttention-2 choice on Hopper)."""
    if CONFIG_OVERRIDE is not None:
        return CONFIG_OVERRIDE
    if max_q_len <= 16:
        return 16, 64, 4, 2
    if max_q_len <= 64 or head_dim > 128 or elem_size > 2:
        return 64, 64, 4, 2
    return 128, 64, 8, 3


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, q_start: torch.Tensor, kv_lens: torch.Tensor,
                     scale: float, *, max_q_len: int | None = None,
                     out: torch.Tensor | None = None,
                     q_lens: torch.Tensor | None = None, return_lse: bool = False,
                     lse_out: torch.Tensor | None = None, window: int | None = None,
                     contiguous: bool = False,
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `paged_torch.extend_attention` (same contract and layout).

    Keyword-only extras: `max_q_len` (an upper bound on the per-sequence query counts; it
    sizes the grid; when omitted it is read from `q_start`, a device sync) and `out` (a
    `[T, num_heads, head_dim]` tensor to write into) and `q_lens` (`[batch]`; when given,
    sequence b's queries are `q[q_start[b] : q_start[b] + q_lens[b]]`, so `q_start` needs
    only `batch` entries and may describe any subset of the packed rows; other rows are
    left untouched: the backend runs a mixed batch's multi-token sequences this way and
    its single-token ones on the decode kernel). Sequences with no queries are allowed;
    `block_tables[b]` must list the first `ceil(kv_lens[b] / page_size)` blocks.
    `return_lse`: return the fp32 output and its natural log-sum-exp `[T, num_heads]`
    (like the reference); `out` must then be float32, and `lse_out` (fp32
    `[T, num_heads]`, rows as in `out`) is where the log-sum-exp goes. `window`: a
    sliding window (a query at position p reads keys p-window+1 .. p), or None.
    `contiguous`: as in `paged_decode_attention` (only each table's first entry is read).
    """
    group, page_size = check_paged(q, k_cache, v_cache, block_tables)
    num_tokens, num_heads, head_dim = q.shape
    batch = kv_lens.shape[0]
    out, lse_out = kernel_outputs(q, out, lse_out, (num_tokens, num_heads, head_dim),
                                  return_lse)
    result = out if lse_out is None else (out, lse_out)
    lse_strides = (0, 0) if lse_out is None else lse_out.stride()
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if num_tokens == 0 or batch == 0:
        return result
    if max_q_len is None:
        max_q_len = int((q_start[1:] - q_start[:-1] if q_lens is None else q_lens).max())
    if max_q_len <= 0:
        return result
    block_m, block_n, num_warps, num_stages = launch_config(max_q_len, head_dim,
                                                            q.element_size())
    grid = (triton.cdiv(max_q_len, block_m), num_heads, batch)
    _extend_kernel[grid](
        q, k_cache, v_cache, block_tables, q_start, q_start if q_lens is None else q_lens,
        kv_lens, out, lse_out if return_lse else out,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), block_tables.stride(1), out.stride(0), out.stride(1),
        lse_strides[0], lse_strides[1],
        scale * LOG2E, 0 if window is None else window,
        GROUP=group, PAGE_SIZE=page_size, HEAD_DIM=head_dim, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_D=block_d(head_dim), PRECISION=dot_precision(q.dtype),
        HAS_Q_LENS=q_lens is not None, WRITE_LSE=return_lse, SLIDING=window is not None,
        CONTIGUOUS=contiguous, num_warps=num_warps,
        num_stages=num_stages)
    return result
