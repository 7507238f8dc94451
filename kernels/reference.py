"""Plain torch references for the paged-attention kernels.

These are the CPU path (the `torch` attention backend calls them) and the ground truth the
Triton kernels are tested against. Shapes used throughout:

- `k_cache`, `v_cache`: `[num_blocks, page_size, num_kv_heads, head_dim]` for one layer.
- a *slot* is `block * page_size + offset`; `slot_mapping[t]` is where token t's KV goes.
- `block_tables`: `[batch, max_blocks]` int32, row b lists sequence b's blocks in order;
  entries past the sequence's last block are ignored (any value).
- `kv_lens[b]`: tokens of sequence b in the cache *after* this step's KV was stored.
"""

from __future__ import annotations

import torch


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Write `k`, `v` (`[T, num_kv_heads, head_dim]`) into the slots `slot_mapping[T]`."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first `num_tokens` cached tokens of each row of `block_tables`, contiguous:
    `[batch, num_tokens, num_kv_heads, head_dim]`."""
    page_size = cache.shape[1]
    num_blocks = -(-num_tokens // page_size)
    blocks = cache[block_tables[:, :num_blocks].long()]  # [B, nb, page, H, D]
    return blocks.flatten(1, 2)[:, :num_tokens]


def decode_blocks(block_tables: torch.Tensor, kv_lens: torch.Tensor,
                  page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks to read for each sequence, `[batch, n]` (n = blocks of the longest), and
    which of the `n * page_size` token positions are real. A sequence's table entries past
    its last block point at its first block (a real, finite one), so a masked-out score
    never multiplies garbage from an unused block."""
    n = -(-int(kv_lens.max()) // page_size)
    blocks = block_tables[:, :n].long()
    own = torch.arange(n, device=kv_lens.device)[None, :] < (kv_lens[:, None] + page_size - 1) // page_size
    valid = torch.arange(n * page_size, device=kv_lens.device)[None, :] < kv_lens[:, None]
    return torch.where(own, blocks, blocks[:, :1]), valid


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, kv_lens: torch.Tensor, scale: float,
                           blocks: tuple[torch.Tensor, torch.Tensor] | None = None,
                           buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
                           ) -> torch.Tensor:
    """One query token per sequence against all of its cached KV.

    `q`: `[batch, num_heads, head_dim]`, the query at position `kv_lens[b] - 1`.
    `blocks`: `decode_blocks(...)`, when the caller computes it once for all layers.
    `buffers`: K and V workspaces of at least `batch * n` blocks; reusing them spares the
    page faults of a fresh allocation of this size at every layer (most of the cost).
    Returns `[batch, num_heads, head_dim]`. Computed in fp32 whatever the input dtype.
    """
    batch, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    index, valid = blocks if blocks is not None else decode_blocks(block_tables, kv_lens, page_size)
    flat = index.flatten()
    shape = (batch, valid.shape[1], num_kv_heads, head_dim)
    if buffers is None:
        k, v = k_cache.index_select(0, flat), v_cache.index_select(0, flat)
    else:
        k = torch.index_select(k_cache, 0, flat, out=buffers[0][:len(flat)])
        v = torch.index_select(v_cache, 0, flat, out=buffers[1][:len(flat)])
    # The query heads of one KV head become that head's query rows: no K/V repeat.
    qg = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim).float()
    out = torch.nn.functional.scaled_dot_product_attention(
        qg, k.view(shape).transpose(1, 2).float(), v.view(shape).transpose(1, 2).float(),
        attn_mask=valid[:, None, None, :], scale=scale)
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, q_start: torch.Tensor, kv_lens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """The new tokens of each sequence attend to its cached prefix and causally to themselves.

    `q`: `[T, num_heads, head_dim]`, sequences packed back to back; sequence b's queries
    are `q[q_start[b]:q_start[b+1]]`, at positions `kv_lens[b] - q_len_b ...
    kv_lens[b] - 1` (their own KV already stored in the cache).
    Returns `[T, num_heads, head_dim]`.
    """
    out = torch.empty_like(q)
    starts = q_start.tolist()
    lens = kv_lens.tolist()
    for b, kv_len in enumerate(lens):
        lo, hi = starts[b], starts[b + 1]
        q_len = hi - lo
        if q_len == 0:
            continue
        k = gather_kv(k_cache, block_tables[b:b + 1], kv_len)[0].transpose(0, 1)  # [Hkv, S, D]
        v = gather_kv(v_cache, block_tables[b:b + 1], kv_len)[0].transpose(0, 1)
        qb = q[lo:hi].transpose(0, 1)  # [H, q_len, D]
        prefix = kv_len - q_len
        if prefix == 0:
            o = torch.nn.functional.scaled_dot_product_attention(
                qb, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            rows = torch.arange(q_len, device=q.device)[:, None] + prefix
            mask = torch.arange(kv_len, device=q.device)[None, :] <= rows
            o = torch.nn.functional.scaled_dot_product_attention(
                qb, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[lo:hi] = o.transpose(0, 1)
    return out
