"""Multi-LoRA in Triton (S-LoRA / Punica style): one batch mixes tokens of different
adapters, and each token's low-rank delta is added to a projection's output by two
kernels, `shrink` (`s = x @ A.T`, down to the rank) and `expand` (`y += s @ B.T`).

Each projection (a fused one too, q/k/v in one) keeps its adapters in S slots, built by
the engine: `a[S, PR, IN]` holds a slot's lora_A rows of every fused part stacked (PR =
parts x max rank, zero-padded), `bt[S, PR, OUT]` its B transposed, scaled, and zero
outside each part's block (part p's outputs read only part p's rank rows). A token picks
its slot in `token_slots[T]`; -1 is the base model (no delta). Slots are not checked
against S: that would read tensor values on the host, which a CUDA graph forbids.

One program per (token, block of outputs), looping over the reduction axis in blocks and
accumulating in fp32, rounded once into the output's dtype; a -1 token reads no weights.
The grid depends on T and the dims alone, and nothing reads a tensor's values on the
host, so both run at fixed shapes inside a CUDA graph. Each token reads its slot's
weights by itself, the right trade for decode (a token or a few per adapter). A long
prefill rereads one adapter's weights once per token: a segment-grouped variant (SGMV:
tokens sorted by slot, a program per segment tile doing `tl.dot` on `[BLOCK_M, ...]`
tiles) would read them once per tile and use the tensor cores. That variant is not
written, and neither kernel has been measured on a GPU yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_RANK = 16
"""Rank rows a tile covers: shrink's outputs per program (so a lone decode token still
spreads its `[PR, IN]` read over PR / 16 programs), expand's reduction step."""
BLOCK_DIM = 256
"""A tile along IN (shrink's reduction step) or OUT (expand's outputs per program)."""


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slot_ptr, out_ptr, stride_x, stride_as, stride_ar,
                   stride_out, IN: tl.constexpr, PR: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < PR
    slot = tl.load(slot_ptr + t).to(tl.int64)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    if slot >= 0:  # -1: the base model, its row stays zero
        rows = a_ptr + slot * stride_as + offs_r[:, None] * stride_ar
        for k0 in range(0, IN, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < IN
            x = tl.load(x_ptr + t * stride_x + offs_k, mask=k_mask, other=0.0)
            a = tl.load(rows + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :],
                        other=0.0)
            # A GEMV per token: too few rows for tl.dot, a multiply and a row sum instead.
            acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], 1)
    tl.store(out_ptr + t * stride_out + offs_r, acc.to(out_ptr.dtype.element_ty), mask=r_mask)


@triton.jit
def _expand_kernel(s_ptr, bt_ptr, slot_ptr, y_ptr, stride_s, stride_bs, stride_br,
                   stride_y, PR: tl.constexpr, OUT: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < OUT
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # -1: the base model, y's row is neither read nor written
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        cols = bt_ptr + slot * stride_bs + offs_n[None, :]
        for r0 in range(0, PR, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            r_mask = offs_r < PR
            s = tl.load(s_ptr + t * stride_s + offs_r, mask=r_mask, other=0.0)
            b = tl.load(cols + offs_r[:, None] * stride_br,
                        mask=r_mask[:, None] & n_mask[None, :], other=0.0)
            acc += tl.sum(s.to(tl.float32)[:, None] * b.to(tl.float32), 0)
        y_row = y_ptr + t * stride_y + offs_n
        y = tl.load(y_row, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_row, (y + acc).to(y_ptr.dtype.element_ty), mask=n_mask)


def _check(name: str, rows: torch.Tensor, weights: torch.Tensor, token_slots: torch.Tensor,
           wname: str) -> None:
    """What both kernels need of their token rows `rows` (`[T, K]`), the slots' weights
    (`[S, *, *]`) and the slots: their dtypes, devices and contiguous last axes."""
    if rows.dim() != 2 or weights.dim() != 3:
        raise ValueError(f"{name} {tuple(rows.shape)} must be [T, dim] and {wname} "
                         f"{tuple(weights.shape)} [S, rows, cols]")
    if rows.dtype not in DTYPES or weights.dtype != rows.dtype:
        raise ValueError(f"{name} ({rows.dtype}) and {wname} ({weights.dtype}) need one "
                         "dtype of float32, bfloat16, float16")
    if token_slots.shape != (rows.shape[0],) or token_slots.dtype not in (torch.int32,
                                                                          torch.int64):
        raise ValueError(f"token_slots {tuple(token_slots.shape)} ({token_slots.dtype}) "
                         f"must be one int32/int64 slot per token of {name}")
    if weights.device != rows.device or token_slots.device != rows.device:
        raise ValueError(f"{name}, {wname} and token_slots must be on one device")
    if rows.stride(-1) != 1 or weights.stride(-1) != 1:
        raise ValueError(f"{name} and {wname} need a contiguous last axis")


def shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """`[T, PR]` (x's dtype): row t is `x[t] @ a[token_slots[t]].T`, zeros where the slot
    is -1. `x`: `[T, IN]`; `a`: `[S, PR, IN]`; `token_slots`: `[T]`, each below S."""
    _check("x", x, a, token_slots, "a")
    if a.shape[2] != x.shape[1]:
        raise ValueError(f"a {tuple(a.shape)} must be [S, PR, IN] for x {tuple(x.shape)}")
    num_tokens, rank_rows = x.shape[0], a.shape[1]
    out = torch.empty((num_tokens, rank_rows), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_r = min(BLOCK_RANK, triton.next_power_of_2(rank_rows))
    _shrink_kernel[(num_tokens, triton.cdiv(rank_rows, block_r))](
        x, a, token_slots, out, x.stride(0), a.stride(0), a.stride(1), out.stride(0),
        IN=x.shape[1], PR=rank_rows, BLOCK_R=block_r,
        BLOCK_K=min(BLOCK_DIM, triton.next_power_of_2(max(1, x.shape[1]))), num_warps=4)
    return out


def expand(s: torch.Tensor, bt: torch.Tensor, token_slots: torch.Tensor,
           y: torch.Tensor) -> None:
    """`y[t] += s[t] @ bt[token_slots[t]]` in place, rows whose slot is -1 untouched.
    `s`: `[T, PR]`; `bt`: `[S, PR, OUT]`; `y`: `[T, OUT]` (its rows may be a strided view,
    such as one part's columns of a fused output); `token_slots`: `[T]`, each below S."""
    _check("s", s, bt, token_slots, "bt")
    if bt.shape[1] != s.shape[1]:
        raise ValueError(f"bt {tuple(bt.shape)} must be [S, PR, OUT] for s {tuple(s.shape)}")
    if y.shape != (s.shape[0], bt.shape[2]) or y.dtype != s.dtype or y.device != s.device:
        raise ValueError(f"y {tuple(y.shape)} ({y.dtype}) must be [T, OUT] for s "
                         f"{tuple(s.shape)} and bt {tuple(bt.shape)}, in their dtype and "
                         "on their device")
    if y.stride(-1) != 1:
        raise ValueError("y needs a contiguous last axis")
    num_tokens, rank_rows, out_dim = s.shape[0], s.shape[1], y.shape[1]
    if num_tokens == 0 or rank_rows == 0 or out_dim == 0:
        return  # nothing to add
    block_n = min(BLOCK_DIM, triton.next_power_of_2(out_dim))
    _expand_kernel[(num_tokens, triton.cdiv(out_dim, block_n))](
        s, bt, token_slots, y, s.stride(0), bt.stride(0), bt.stride(1), y.stride(0),
        PR=rank_rows, OUT=out_dim, BLOCK_R=min(BLOCK_RANK, triton.next_power_of_2(rank_rows)),
        BLOCK_N=block_n, num_warps=4)
