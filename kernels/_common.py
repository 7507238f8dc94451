"""Small helpers shared by the Triton kernels: launch-time checks and constants."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
"""The kernels work in base 2 (`exp2`): scores are scaled by `scale * log2(e)`."""
LN2 = tl.constexpr(0.6931471805599453)
"""A base-2 log-sum-exp times this is the natural one the `return_lse` APIs give (a
`constexpr`, so the kernels may read it as a global)."""


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: exact fp32 (`ieee`, not TF32) for float32 inputs, so the
    fp32 path matches the torch reference; half types use the tensor cores as they are."""
    return "ieee" if dtype == torch.float32 else "tf32"


def block_d(head_dim: int) -> int:
    """Head-dim tile: the next power of two (64 and 128 fit exactly; 80/96 are masked)."""
    return max(16, triton.next_power_of_2(head_dim))


def check_cache(q: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> tuple[int, int]:
    """Validate the q/cache layout the kernels assume; returns `(group, page_size)`.

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
    return num_heads // num_kv_heads, k_cache.shape[1]


def check_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_tables: torch.Tensor) -> tuple[int, int]:
    """`check_cache`, and `block_tables` a 2-d int32/int64 tensor."""
    group_page = check_cache(q, k_cache, v_cache)
    if block_tables.dim() != 2 or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError("block_tables must be a 2-d int32/int64 tensor")
    return group_page


def check_lse_out(out: torch.Tensor | None, lse: torch.Tensor | None, shape: tuple[int, ...],
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 output `shape` and log-sum-exp `shape[:-1]` tensors of a `return_lse`
    call: the caller's (checked) or fresh ones."""
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=device)
    if lse is None:
        lse = torch.empty(shape[:-1], dtype=torch.float32, device=device)
    if out.dtype != torch.float32 or lse.dtype != torch.float32:
        raise ValueError("with return_lse, out and lse_out must be float32")
    if tuple(out.shape) != tuple(shape) or tuple(lse.shape) != tuple(shape[:-1]):
        raise ValueError(f"out/lse_out shapes {tuple(out.shape)}/{tuple(lse.shape)} do not "
                         f"fit {tuple(shape)}")
    if out.stride(-1) != 1:
        raise ValueError("out needs a contiguous head_dim axis")
    return out, lse
