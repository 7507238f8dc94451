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


@triton.jit
def paged_softmax_pass(q, table_ptr, stride_table, start, end, k_ptr, v_ptr, kv_head,
                       stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
                       qk_scale, ROWS: tl.constexpr, PAGE_SIZE: tl.constexpr,
                       HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       PRECISION: tl.constexpr, CONTIGUOUS: tl.constexpr):
    """Online softmax of the query tile `q` (`[ROWS, BLOCK_D]`, one KV head's rows) over
    the paged tokens `start .. end` of one KV head: token t lives in block
    `table_ptr[(t // PAGE_SIZE) * stride_table]` at offset `t % PAGE_SIZE`, or, when
    `CONTIGUOUS` (see `token_blocks`), in block `table_ptr[0] + t // PAGE_SIZE`.
    Base 2, fp32. Returns the running max `m`, sum `l` and unnormalised output `acc`."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    first = tl.load(table_ptr).to(tl.int64) if CONTIGUOUS else 0
    for n0 in range(start, end, BLOCK_N):
        toks = n0 + offs_n
        n_mask = toks < end
        blk = token_blocks(table_ptr, stride_table, first, toks, n_mask, PAGE_SIZE,
                           CONTIGUOUS, True)
        page_off = toks % PAGE_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_off = blk * stride_kb + page_off * stride_kp + kv_head * stride_kh
        k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [ROWS, N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = blk * stride_vb + page_off * stride_vp + kv_head * stride_vh
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def token_blocks(table_ptr, stride_table, first, toks, mask, PAGE_SIZE: tl.constexpr,
                 CONTIGUOUS: tl.constexpr, MASKED: tl.constexpr):
    """The blocks (int64) holding tokens `toks` of the sequence whose table is at
    `table_ptr` (`mask`: the tokens that exist, read when `MASKED`). `CONTIGUOUS`: the
    sequence's blocks are consecutive ids over a cache whose blocks lie back to back (the
    virtual layout's views, `worker/virtual_kv.py`), so its KV is one contiguous range:
    block `first + t // PAGE_SIZE` (`first` = `table_ptr[0]`), and no table is read."""
    if CONTIGUOUS:
        blk = first + toks // PAGE_SIZE
    elif MASKED:
        blk = tl.load(table_ptr + (toks // PAGE_SIZE) * stride_table, mask=mask,
                      other=0).to(tl.int64)
    else:
        blk = tl.load(table_ptr + (toks // PAGE_SIZE) * stride_table).to(tl.int64)
    return blk


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


def kernel_outputs(q: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None,
                   shape: tuple[int, ...], return_lse: bool
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An attention kernel's output tensor (the caller's, or a fresh one in q's dtype) and,
    with `return_lse`, its log-sum-exp one (`check_lse_out`); None without."""
    if return_lse:
        return check_lse_out(out, lse, shape, q.device)
    return (torch.empty(shape, dtype=q.dtype, device=q.device) if out is None else out), None
