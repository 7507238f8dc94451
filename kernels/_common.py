"""Small helpers shared by the Triton kernels: launch-time checks and constants."""

from __future__ import annotations

import torch
import triton

LOG2E = 1.4426950408889634
"""The kernels work in base 2 (`exp2`): scores are scaled by `scale * log2(e)`."""


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: exact fp32 (`ieee`, not TF32) for float32 inputs, so the
    fp32 path matches the torch reference; half types use the tensor cores as they are."""
    return "ieee" if dtype == torch.float32 else "tf32"


def block_d(head_dim: int) -> int:
    """Head-dim tile: the next power of two (64 and 128 fit exactly; 80/96 are masked)."""
    return max(16, triton.next_power_of_2(head_dim))


def check_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_tables: torch.Tensor) -> tuple[int, int]:
    """Validate the layout the kernels assume; returns `(group, page_size)`.

    The last (head_dim) axis of `q` and of both caches must be contiguous; every other
    axis may be strided (e.g. `q` sliced out of a fused qkv projection).
    """
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous head_dim axis")
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError("k_cache/v_cache must both be [num_blocks, page_size, kv_heads, dim]")
    num_heads, head_dim = q.shape[-2:]
    num_kv_heads = k_cache.shape[2]
    if head_dim != k_cache.shape[3] or num_heads % num_kv_heads:
        raise ValueError(f"q heads/dim {tuple(q.shape[-2:])} do not fit the cache "
                         f"{tuple(k_cache.shape[2:])}")
    if block_tables.dim() != 2 or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError("block_tables must be a 2-d int32/int64 tensor")
    return num_heads // num_kv_heads, k_cache.shape[1]
