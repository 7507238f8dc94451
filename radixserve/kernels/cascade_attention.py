"""Tree (cascade) attention in Triton: the shared-run pass of one level, and the merge.

`cascade_level_attention` is the Triton version of `paged_torch.cascade_level_attention`:
each shared run (whole blocks that every one of its query rows may see in full) is read
once for all the rows that share it, not once per sequence.

Design. Grid `(row tiles x splits, num_kv_heads, num_runs)`. For one run and one KV head,
the query heads of that KV head for all of the run's rows are the rows of one packed
matrix (`packed row p` = run row `p // GROUP`, query head `kv_head * GROUP + p % GROUP`),
cut into tiles of `BLOCK_M` packed rows; each program loads its tile of q once and walks
the run's tokens in tiles of `BLOCK_N` (`tl.dot` against K, online softmax in fp32 and
base 2, `tl.dot` of the probabilities with V). The tiles of one run and KV head are
neighbours in launch order, so a run longer than L2 is still fetched from memory about
once per KV head. A token's address is `blocks[block_offsets[run] + tok // page_size]`
(any page size; the runs' blocks need not be consecutive). No mask beyond the run's end:
every query of a run sees all of it (that is what makes it shared).

Split-KV: when the runs x KV heads x row tiles cannot fill the GPU and the runs are long
(decode over a long system prompt: few programs, each reading the whole run), each run's
tokens are cut into `num_splits` ranges; pass 1 writes each range's normalised partial
and its base-2 log-sum-exp into an fp32 workspace (a range past its run's end writes
-inf and nothing else), pass 2 merges the ranges of each (row, head) by their weights.

`merge_attention_states_` folds partial states into accumulators in place (the one
launch per level that joins a shared-run pass to the own parts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import triton
import triton.language as tl

from radixserve.kernels._common import (LN2, LOG2E, block_d, check_cache, dot_precision,
                                        paged_softmax_pass)
from radixserve.kernels.decode_attention import _num_sms

BLOCK_N = 64
"""Run tokens per inner-loop tile."""
MAX_BLOCK_M = 64
"""The largest tile of packed query rows (`rows x group`); smaller when runs are small,
and 16 for fp32 inputs (exact fp32 dots run on FMAs: 32- and 64-row tiles spill)."""
MIN_SPLIT_TOKENS = 256
"""A split covers at least this many run tokens (a program here does `BLOCK_M` rows of
work per token, more than a decode program, so shorter ranges than decode's pay off)."""
MAX_SPLITS = 16
NUM_WARPS = 4
NUM_STAGES = 2
"""Launch knobs (module-level so that bench/gpu/ can sweep them)."""


@triton.jit
def _cascade_kernel(q_ptr, k_ptr, v_ptr, rows_ptr, row_off_ptr, blocks_ptr, block_off_ptr,
                    o_ptr, lse_ptr,
                    stride_qt, stride_qh, stride_kb, stride_kp, stride_kh,
                    stride_vb, stride_vp, stride_vh,
                    stride_or, stride_oh, stride_os, stride_lr, stride_lh,
                    qk_scale, split_len, num_tiles,
                    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    PRECISION: tl.constexpr, SPLIT: tl.constexpr, CONTIGUOUS: tl.constexpr):
    tile = tl.program_id(0) % num_tiles
    split = tl.program_id(0) // num_tiles
    kv_head = tl.program_id(1)
    run = tl.program_id(2)
    r_lo = tl.load(row_off_ptr + run)
    packed = (tl.load(row_off_ptr + run + 1) - r_lo) * GROUP
    m_start = tile * BLOCK_M
    if m_start >= packed:
        return
    b_lo = tl.load(block_off_ptr + run)
    num_tokens = (tl.load(block_off_ptr + run + 1) - b_lo) * PAGE_SIZE

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < packed
    d_mask = offs_d < HEAD_DIM
    row = (r_lo + offs_m // GROUP).to(tl.int64)  # index into rows / the outputs
    head = kv_head * GROUP + offs_m % GROUP
    o_off = row[:, None] * stride_or + head[:, None] * stride_oh + offs_d[None, :]
    l_off = row * stride_lr + head * stride_lh
    start = split * split_len
    if start >= num_tokens:  # a split past this run's end (SPLIT only): weight 0
        tl.store(lse_ptr + l_off + split, tl.full([BLOCK_M], float("-inf"), tl.float32),
                 mask=m_mask)
        return
    end = tl.minimum(num_tokens, start + split_len)

    tok = tl.load(rows_ptr + row, mask=m_mask, other=0).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    m_i, l_i, acc = paged_softmax_pass(
        q, blocks_ptr + b_lo, 1, start, end, k_ptr, v_ptr, kv_head, stride_kb, stride_kp,
        stride_kh, stride_vb, stride_vp, stride_vh, qk_scale, BLOCK_M, PAGE_SIZE, HEAD_DIM,
        BLOCK_N, BLOCK_D, PRECISION, CONTIGUOUS)
    out = acc / l_i[:, None]
    om_mask = m_mask[:, None] & d_mask[None, :]
    if SPLIT:
        tl.store(o_ptr + o_off + split * stride_os, out, mask=om_mask)
        tl.store(lse_ptr + l_off + split, m_i + tl.log2(l_i), mask=m_mask)
    else:
        tl.store(o_ptr + o_off, out, mask=om_mask)
        tl.store(lse_ptr + l_off, (m_i + tl.log2(l_i)) * LN2, mask=m_mask)


@triton.jit
def _split_merge_kernel(mid_ptr, mid_lse_ptr, o_ptr, lse_ptr,
                        stride_mr, stride_mh, stride_ms, stride_mlr, stride_mlh,
                        stride_or, stride_oh, stride_lr, stride_lh, num_splits,
                        HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    lse = tl.load(mid_lse_ptr + r * stride_mlr + head * stride_mlh + offs_s,
                  mask=offs_s < num_splits, other=float("-inf"))
    valid = lse > float("-inf")  # split 0 always is: every run has a token
    lse_max = tl.max(lse, 0)
    w = tl.where(valid, tl.exp2(lse - lse_max), 0.0)
    mid = tl.load(mid_ptr + r * stride_mr + head * stride_mh + offs_s[:, None] * stride_ms
                  + offs_d[None, :], mask=valid[:, None] & (offs_d[None, :] < HEAD_DIM),
                  other=0.0)
    w_sum = tl.sum(w, 0)
    tl.store(o_ptr + r * stride_or + head * stride_oh + offs_d,
             tl.sum(mid * w[:, None], 0) / w_sum, mask=offs_d < HEAD_DIM)
    tl.store(lse_ptr + r * stride_lr + head * stride_lh, (lse_max + tl.log2(w_sum)) * LN2)


@dataclass(frozen=True)
class RunOffsets:
    """A level's run offsets as the kernel reads them (device int32), with the host-side
    sizes that shape its grid; build once per step with `run_offsets`, reuse per layer."""

    row_offsets: torch.Tensor
    block_offsets: torch.Tensor
    run_rows: tuple[int, ...]
    """Query rows of each run."""
    max_blocks: int
    """The most blocks of any run."""

    @property
    def num_runs(self) -> int:
        return len(self.run_rows)

    @property
    def total_rows(self) -> int:
        return sum(self.run_rows)


def run_offsets(row_offsets: list[int], block_offsets: list[int], device: torch.device | str,
                to_device: Callable[[list[list[int]], torch.device | str, torch.dtype],
                                    torch.Tensor] | None = None) -> RunOffsets:
    """`RunOffsets` of the lists `paged_torch.cascade_level_attention` takes (one copy to
    the device, no sync). `to_device`: how the offsets reach the device (the worker's
    pinned staging, `worker/staging.py`; None: a plain copy)."""
    if len(row_offsets) != len(block_offsets) or len(row_offsets) < 1:
        raise ValueError("row_offsets and block_offsets need one entry per run, plus one")
    rows = [b - a for a, b in zip(row_offsets, row_offsets[1:])]
    blocks = [b - a for a, b in zip(block_offsets, block_offsets[1:])]
    if any(n < 1 for n in blocks) or any(n < 0 for n in rows):
        raise ValueError("every run needs at least one block (and no negative row count)")
    host = [row_offsets, block_offsets]
    both = (torch.tensor(host, dtype=torch.int32, device=device) if to_device is None
            else to_device(host, device, torch.int32))
    return RunOffsets(both[0], both[1], tuple(rows), max(blocks, default=0))


def tile_rows(max_packed_rows: int, elem_size: int = 2) -> int:
    """`BLOCK_M`: the packed rows of the biggest run, as a power of two in [16, MAX_BLOCK_M]
    (16 for fp32 inputs)."""
    cap = MAX_BLOCK_M if elem_size <= 2 else 16
    return max(16, min(cap, triton.next_power_of_2(max(1, max_packed_rows))))


def choose_num_splits(programs: int, max_run_tokens: int, num_sms: int) -> int:
    """Split only when the programs fill less than two waves of SMs, and never cut a range
    below `MIN_SPLIT_TOKENS` tokens."""
    if programs >= 2 * num_sms or max_run_tokens < 2 * MIN_SPLIT_TOKENS:
        return 1
    want = math.ceil(2 * num_sms / max(1, programs))
    return max(1, min(want, max_run_tokens // MIN_SPLIT_TOKENS, MAX_SPLITS))


def _workspace(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """fp32 scratch for the split path (a seam for tests, which poison it)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def cascade_level_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            rows: torch.Tensor, row_offsets: list[int], blocks: torch.Tensor,
                            block_offsets: list[int], scale: float, *,
                            offsets: RunOffsets | None = None, num_splits: int | None = None,
                            out: torch.Tensor | None = None, lse_out: torch.Tensor | None = None,
                            contiguous: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `paged_torch.cascade_level_attention` (same contract and layout):
    run g's query rows `rows[row_offsets[g]:row_offsets[g+1]]` of `q` (`[T, H, D]`) attend
    to every token of its whole blocks `blocks[block_offsets[g]:block_offsets[g+1]]`;
    returns fp32 `o` `[R, H, D]` and the natural log-sum-exp `[R, H]`, in `rows` order.

    Keyword-only extras: `offsets` (`run_offsets(row_offsets, block_offsets, device)`,
    built once per step; the lists are then not read), `num_splits` (force the split
    count; default from `choose_num_splits`), `out` / `lse_out` (fp32 tensors to write).
    `rows` and `blocks` are int32/int64 device tensors; every run has >= 1 block.
    `contiguous`: each run's blocks are consecutive ids over caches whose blocks lie back
    to back (the virtual layout), so only its first is read.
    """
    group, page_size = check_cache(q, k_cache, v_cache)
    if offsets is None:
        offsets = run_offsets(row_offsets, block_offsets, q.device)
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    total = int(rows.shape[0])
    if total != offsets.total_rows:
        raise ValueError(f"{total} rows, but the run offsets cover {offsets.total_rows}")
    if out is None:
        out = torch.empty((total, num_heads, head_dim), dtype=torch.float32, device=q.device)
    if lse_out is None:
        lse_out = torch.empty((total, num_heads), dtype=torch.float32, device=q.device)
    if out.dtype != torch.float32 or lse_out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError("out and lse_out must be float32 (out with a contiguous head_dim)")
    if total == 0 or offsets.num_runs == 0:
        return out, lse_out
    max_packed = max(offsets.run_rows) * group
    block_m = tile_rows(max_packed, q.element_size())
    num_tiles = triton.cdiv(max_packed, block_m)
    max_tokens = offsets.max_blocks * page_size
    if num_splits is None:
        # The row tiles that do work (not the grid's padding), once per KV head.
        tiles = sum(triton.cdiv(n * group, block_m) for n in offsets.run_rows)
        num_splits = choose_num_splits(tiles * num_kv_heads, max_tokens, _num_sms(q.device))
    num_splits = max(1, min(num_splits, triton.cdiv(max_tokens, BLOCK_N)))
    split_len = triton.cdiv(triton.cdiv(max_tokens, num_splits), BLOCK_N) * BLOCK_N
    grid = (num_tiles * num_splits, num_kv_heads, offsets.num_runs)
    common = dict(GROUP=group, PAGE_SIZE=page_size, HEAD_DIM=head_dim, BLOCK_M=block_m,
                  BLOCK_N=BLOCK_N, BLOCK_D=block_d(head_dim), PRECISION=dot_precision(q.dtype),
                  CONTIGUOUS=contiguous, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    args = (q, k_cache, v_cache, rows, offsets.row_offsets, blocks, offsets.block_offsets)
    strides = (q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3])
    if num_splits == 1:
        _cascade_kernel[grid](*args, out, lse_out, *strides, out.stride(0), out.stride(1), 0,
                              lse_out.stride(0), lse_out.stride(1), scale * LOG2E, split_len,
                              num_tiles, SPLIT=False, **common)
        return out, lse_out
    mid = _workspace((total, num_heads, num_splits, head_dim), q.device)
    mid_lse = _workspace((total, num_heads, num_splits), q.device)
    _cascade_kernel[grid](*args, mid, mid_lse, *strides, mid.stride(0), mid.stride(1),
                          mid.stride(2), mid_lse.stride(0), mid_lse.stride(1), scale * LOG2E,
                          split_len, num_tiles, SPLIT=True, **common)
    _split_merge_kernel[(total, num_heads)](
        mid, mid_lse, out, lse_out, mid.stride(0), mid.stride(1), mid.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1), lse_out.stride(0),
        lse_out.stride(1), num_splits, HEAD_DIM=head_dim,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)), BLOCK_D=block_d(head_dim),
        num_warps=4)
    return out, lse_out


@triton.jit
def _merge_states_kernel(acc_o_ptr, acc_lse_ptr, index_ptr, o_ptr, lse_ptr,
                         stride_ar, stride_ah, stride_alr, stride_alh,
                         stride_or, stride_oh, stride_lr, stride_lh,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = heads < NUM_HEADS
    hd_mask = h_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    a = tl.load(index_ptr + r).to(tl.int64)
    a_lse = tl.load(acc_lse_ptr + a * stride_alr + heads * stride_alh, mask=h_mask,
                    other=float("-inf"))
    b_lse = tl.load(lse_ptr + r * stride_lr + heads * stride_lh, mask=h_mask,
                    other=float("-inf"))
    m = tl.maximum(a_lse, b_lse)
    m = tl.where(m > float("-inf"), m, 0.0)  # both empty: weights 0, state kept below
    wa = tl.exp(a_lse - m)
    wb = tl.exp(b_lse - m)
    total = wa + wb
    keep = total > 0
    total = tl.where(keep, total, 1.0)
    a_off = a * stride_ar + heads[:, None] * stride_ah + offs_d[None, :]
    a_o = tl.load(acc_o_ptr + a_off, mask=hd_mask, other=0.0)
    b_o = tl.load(o_ptr + r * stride_or + heads[:, None] * stride_oh + offs_d[None, :],
                  mask=hd_mask, other=0.0)
    # A side with weight 0 (lse -inf) is not read into the sum: its o may be anything.
    merged = (tl.where(wa[:, None] > 0, a_o * wa[:, None], 0.0)
              + tl.where(wb[:, None] > 0, b_o * wb[:, None], 0.0)) / total[:, None]
    tl.store(acc_o_ptr + a_off, merged, mask=hd_mask & keep[:, None])
    tl.store(acc_lse_ptr + a * stride_alr + heads * stride_alh, m + tl.log(total),
             mask=h_mask & keep)


MERGE_BLOCK_H = 16
"""Query heads per merge program."""


def merge_attention_states_(acc_o: torch.Tensor, acc_lse: torch.Tensor, index: torch.Tensor,
                            o: torch.Tensor, lse: torch.Tensor) -> None:
    """Triton version of `paged_torch.merge_attention_states_`, in place: rows `index` of
    `acc_o` (`[N, H, D]` fp32) and `acc_lse` (`[N, H]` fp32) become the attention over the
    union of their keys and those of `o`, `lse` (`[R, H, D]`, `[R, H]` fp32, one row per
    index; the entries of `index` distinct). A log-sum-exp of -inf (no keys) contributes
    nothing, whichever side it is on (the other side is kept as it is; when both are -inf
    the accumulator row is left unchanged)."""
    if any(t.dtype != torch.float32 for t in (acc_o, acc_lse, o, lse)):
        raise ValueError("merge_attention_states_ takes float32 states")
    if acc_o.stride(-1) != 1 or o.stride(-1) != 1:
        raise ValueError("acc_o and o need a contiguous head_dim axis")
    num_rows = index.shape[0]
    num_heads, head_dim = acc_o.shape[1:]
    if o.shape != (num_rows, num_heads, head_dim) or lse.shape != (num_rows, num_heads) \
            or acc_lse.shape != acc_o.shape[:2]:
        raise ValueError(f"state shapes do not fit: acc {tuple(acc_o.shape)}/"
                         f"{tuple(acc_lse.shape)}, partial {tuple(o.shape)}/{tuple(lse.shape)}"
                         f", {num_rows} indices")
    if num_rows == 0:
        return
    block_h = min(MERGE_BLOCK_H, triton.next_power_of_2(num_heads))
    _merge_states_kernel[(num_rows, triton.cdiv(num_heads, block_h))](
        acc_o, acc_lse, index, o, lse, acc_o.stride(0), acc_o.stride(1), acc_lse.stride(0),
        acc_lse.stride(1), o.stride(0), o.stride(1), lse.stride(0), lse.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d(head_dim),
        num_warps=4)
