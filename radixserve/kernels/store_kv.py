"""KV store in Triton: write the new tokens' K and V into their slots of the paged cache.

Design. One program per new token: it reads the token's `[num_kv_heads, head_dim]` K and V
tiles (any token/head strides, e.g. slices of a fused qkv projection) and writes them at
`slot // page_size, slot % page_size` of the caches (any block/page/head strides, int64
address arithmetic, so caches past 2**31 elements are fine). A negative slot means
"padding, do not store" (the torch reference has no such case; it is free here).

RoPE is not fused: the model rotates q and k together in one elementwise pass before
attention, and fusing the k half here would save one read and write of `[T, Hkv, D]`,
which is small next to the attention itself, at the cost of a second signature.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.kernels._common import block_d


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kcp, stride_kch, stride_vcb, stride_vcp, stride_vch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // PAGE_SIZE
    page_off = slot % PAGE_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :],
                mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
                mask=mask)
    k_dst = blk * stride_kcb + page_off * stride_kcp + offs_h[:, None] * stride_kch
    v_dst = blk * stride_vcb + page_off * stride_vcp + offs_h[:, None] * stride_vch
    tl.store(k_cache_ptr + k_dst + offs_d[None, :], k.to(k_cache_ptr.dtype.element_ty),
             mask=mask)
    tl.store(v_cache_ptr + v_dst + offs_d[None, :], v.to(v_cache_ptr.dtype.element_ty),
             mask=mask)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Triton version of `paged_torch.store_kv`: write `k`, `v` (`[T, num_kv_heads,
    head_dim]`) into the slots `slot_mapping[T]` (int32 or int64) of the caches
    (`[num_blocks, page_size, num_kv_heads, head_dim]`). Slots must be distinct (a
    duplicate slot's winner is unspecified); negative slots are skipped. The head_dim axis
    of every tensor must be contiguous.
    """
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    num_kv_heads, head_dim = k_cache.shape[-2:]
    if k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k/v {tuple(k.shape)} do not fit the cache {tuple(k_cache.shape)}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError("slot_mapping needs one slot per token")
    if any(t.stride(-1) != 1 for t in (k, v, k_cache, v_cache)):
        raise ValueError("k, v and the caches need a contiguous head_dim axis")
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=block_d(head_dim),
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4)
