"""The decoder layer's elementwise work fused in Triton, so an eager decode step launches
fewer kernels (issue 43: at most 12 per layer on CUDA, counted in
tests/kernels/test_fused.py): the residual add with RMSNorm, RoPE with the KV store, and
SiLU(gate) x up.

The norm and SiLU x up round as the torch path in `model/llama.py` does (the sum into the
residual stream in its dtype, the norm in fp32 cast before the weight, SiLU rounded before
the product); the rotation is computed in fp32 and rounded once (torch rounds each of its
three steps in half types: a unit in the last place apart at most). In fp32 the two paths
agree to the last bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.kernels._common import block_d


@triton.jit
def _add_rms_norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, stride_x, stride_delta,
                         stride_out, eps, HIDDEN: tl.constexpr, BLOCK: tl.constexpr,
                         HAS_DELTA: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * stride_delta + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * stride_x + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / HIDDEN + eps)
    normed = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (w * normed).to(out_ptr.dtype.element_ty),
             mask=mask)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """`x += delta` in place (the residual stream; skipped when `delta` is None), then the
    RMSNorm of `x` times `weight`, as a new tensor: `llama.RMSNorm.forward` in one pass.
    `x`, `delta`: `[T, hidden]` with a contiguous last axis."""
    if x.dim() != 2 or x.stride(-1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError(f"x {tuple(x.shape)} must be [T, hidden] with a contiguous hidden "
                         f"axis, and the weight {tuple(weight.shape)} [hidden]")
    if delta is not None and (delta.shape != x.shape or delta.stride(-1) != 1):
        raise ValueError(f"delta {tuple(delta.shape)} does not fit x {tuple(x.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    block = triton.next_power_of_2(x.shape[1])
    _add_rms_norm_kernel[(x.shape[0],)](
        x, x if delta is None else delta, weight, out, x.stride(0),
        0 if delta is None else delta.stride(0), out.stride(0), eps, HIDDEN=x.shape[1],
        BLOCK=block, HAS_DELTA=delta is not None, num_warps=4 if block <= 4096 else 8)
    return out


@triton.jit
def _rotate(ptr, row, stride_h, cos, sin, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
            BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """The rotated `[BLOCK_H, BLOCK_D]` heads at `ptr + row` in fp32 (transformers'
    `rotate_half`: the first half pairs with minus the second)."""
    half: tl.constexpr = HEAD_DIM // 2
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    base = ptr + row + offs_h[:, None] * stride_h
    x = tl.load(base + offs_d[None, :], mask=mask, other=0.0)
    partner = tl.load(base + ((offs_d + half) % HEAD_DIM)[None, :], mask=mask,
                      other=0.0).to(tl.float32)
    partner = tl.where((offs_d < half)[None, :], -partner, partner)  # negated in fp32
    return x.to(tl.float32) * cos[None, :] + partner * sin[None, :], mask


@triton.jit
def _rope_store_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
                          slot_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                          stride_vh, stride_cos, stride_sin, stride_kcb, stride_kcp,
                          stride_kch, stride_vcb, stride_vcp, stride_vch,
                          NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                          HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    # The tables hold cos and sin in the activations' dtype: the torch path's factors.
    cos = tl.load(cos_ptr + t * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_sin + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    q, q_mask = _rotate(q_ptr, t * stride_qt, stride_qh, cos, sin, NUM_HEADS, HEAD_DIM,
                        BLOCK_H, BLOCK_D)
    offs_h = tl.arange(0, BLOCK_H)
    tl.store(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
             q.to(q_ptr.dtype.element_ty), mask=q_mask)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # a negative slot: padding, nothing stored
        k, kv_mask = _rotate(k_ptr, t * stride_kt, stride_kh, cos, sin, NUM_KV_HEADS,
                             HEAD_DIM, BLOCK_KV, BLOCK_D)
        offs_kv = tl.arange(0, BLOCK_KV)
        v = tl.load(v_ptr + t * stride_vt + offs_kv[:, None] * stride_vh + offs_d[None, :],
                    mask=kv_mask)
        blk, page_off = slot // PAGE_SIZE, slot % PAGE_SIZE
        k_dst = blk * stride_kcb + page_off * stride_kcp + offs_kv[:, None] * stride_kch
        v_dst = blk * stride_vcb + page_off * stride_vcp + offs_kv[:, None] * stride_vch
        tl.store(k_cache_ptr + k_dst + offs_d[None, :], k.to(k_cache_ptr.dtype.element_ty),
                 mask=kv_mask)
        tl.store(v_cache_ptr + v_dst + offs_d[None, :], v.to(v_cache_ptr.dtype.element_ty),
                 mask=kv_mask)


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Rotate `q` (`[T, heads, head_dim]`) in place and write the rotated `k` and `v`
    (`[T, kv_heads, head_dim]`; `k` itself is left as it was) into the slots
    `slot_mapping[T]` of the caches, as `store_kv.store_kv` does (negative slots are
    skipped). `cos`, `sin`: `[T, head_dim]` (or `[T, 1, head_dim]`), each token's position's
    factors, as `rotary.apply_rotary` takes them. Every tensor's last axis is contiguous."""
    num_tokens = q.shape[0]
    num_kv_heads, head_dim = k_cache.shape[-2:]
    if k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape or \
            q.dim() != 3 or q.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"q {tuple(q.shape)}, k/v {tuple(k.shape)} do not fit the cache "
                         f"{tuple(k_cache.shape)} (an even head_dim)")
    cos, sin = cos.reshape(num_tokens, -1), sin.reshape(num_tokens, -1)
    if cos.shape != (num_tokens, head_dim) or sin.shape != cos.shape:
        raise ValueError(f"cos/sin {tuple(cos.shape)} must be [T, head_dim]")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError("slot_mapping needs one slot per token")
    if any(t.stride(-1) != 1 for t in (q, k, v, cos, sin, k_cache, v_cache)):
        raise ValueError("q, k, v, cos, sin and the caches need a contiguous last axis")
    if num_tokens == 0:
        return
    _rope_store_kv_kernel[(num_tokens,)](
        q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        *k_cache.stride()[:3], *v_cache.stride()[:3], NUM_HEADS=q.shape[1],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(q.shape[1]),
        BLOCK_KV=triton.next_power_of_2(num_kv_heads), BLOCK_D=block_d(head_dim),
        num_warps=1 if q.shape[1] * head_dim <= 512 else 4)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, SIZE: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < SIZE
    gate = tl.load(gate_up_ptr + row * stride_in + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + SIZE + offs, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (silu * up.to(tl.float32)).to(dtype),
             mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of a fused gate/up projection's output `[T, 2 * size]` (gate
    first): `[T, size]`, as `llama.silu_mul` computes it."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} must be [T, 2 * size] with a "
                         "contiguous last axis")
    size = gate_up.shape[1] // 2
    out = torch.empty((gate_up.shape[0], size), dtype=gate_up.dtype, device=gate_up.device)
    if gate_up.shape[0] == 0:
        return out
    block = min(1024, triton.next_power_of_2(size))
    _silu_mul_kernel[(gate_up.shape[0], triton.cdiv(size, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), SIZE=size, BLOCK=block,
        num_warps=4)
    return out
