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


def decode_slots(block_tables: torch.Tensor, kv_lens: torch.Tensor,
                 page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot of every cached token of each sequence, `[batch, max_len]`, and which of
    them are real. Positions past a sequence's end point at its first token (a real,
    finite entry), so a masked-out score never multiplies garbage from an unused slot."""
    max_len = int(kv_lens.max())
    pos = torch.arange(max_len, device=kv_lens.device)
    slots = block_tables[:, pos // page_size].long() * page_size + pos % page_size
    valid = pos[None, :] < kv_lens[:, None]
    return torch.where(valid, slots, slots[:, :1]), valid


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, kv_lens: torch.Tensor, scale: float,
                           slots: tuple[torch.Tensor, torch.Tensor] | None = None,
                           ) -> torch.Tensor:
    """One query token per sequence against all of its cached KV.

    `q`: `[batch, num_heads, head_dim]`, the query at position `kv_lens[b] - 1`.
    `slots`: `decode_slots(...)`, when the caller computes it once for all layers.
    Returns `[batch, num_heads, head_dim]`. Computed in fp32 whatever the input dtype.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    index, valid = slots if slots is not None else decode_slots(
        block_tables, kv_lens, k_cache.shape[1])
    shape = (batch, index.shape[1], num_kv_heads, head_dim)
    k = k_cache.reshape(-1, num_kv_heads, head_dim).index_select(0, index.flatten())
    v = v_cache.reshape(-1, num_kv_heads, head_dim).index_select(0, index.flatten())
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
