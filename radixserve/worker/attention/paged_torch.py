"""Paged attention in plain torch: the production CPU path (the `torch` attention backend
calls these) and the ground truth the Triton kernels (kernels/) are tested against. Shapes
used throughout:

- `k_cache`, `v_cache`: `[num_blocks, page_size, num_kv_heads, head_dim]` for one layer.
- a *slot* is `block * page_size + offset`; `slot_mapping[t]` is where token t's KV goes.
- `block_tables`: `[batch, max_blocks]` int32, row b lists sequence b's blocks in order;
  entries past the sequence's last block are ignored (any value).
- `kv_lens[b]`: tokens of sequence b in the cache *after* this step's KV was stored.
"""

from __future__ import annotations

from typing import Literal, overload

import torch


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Write `k`, `v` (`[T, num_kv_heads, head_dim]`) into the slots `slot_mapping[T]`
    (block * page_size + row) of caches `[blocks, page_size, ...]` of any block stride (the
    Triton store's ground truth; the torch backend stores so, each slot's (block, row) made
    once for all layers)."""
    page_size = k_cache.shape[1]
    index = slot_mapping // page_size, slot_mapping % page_size
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)


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
    pages = (kv_lens[:, None] + page_size - 1) // page_size
    own = torch.arange(n, device=kv_lens.device)[None, :] < pages
    valid = torch.arange(n * page_size, device=kv_lens.device)[None, :] < kv_lens[:, None]
    return torch.where(own, blocks, blocks[:, :1]), valid


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, kv_lens: torch.Tensor, scale: float,
                           blocks: tuple[torch.Tensor, torch.Tensor] | None = None,
                           buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
                           return_lse: bool = False, window: int | None = None,
                           ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One query token per sequence against all of its cached KV (or, with `window`, its
    last `window` keys).

    `q`: `[batch, num_heads, head_dim]`, the query at position `kv_lens[b] - 1`.
    `blocks`: `decode_blocks(...)`, when the caller computes it once for all layers (its
    mask may be given as `additive_mask(valid, torch.float32)`, also made once).
    `buffers`: K and V workspaces of at least `batch * n` blocks; reusing them spares the
    page faults of a fresh allocation of this size at every layer (most of the cost).
    Returns `[batch, num_heads, head_dim]`, and with `return_lse` also the fp32 output and
    its natural log-sum-exp `[batch, num_heads]` (for merging with other partials).
    Computed in fp32 whatever the input dtype.
    """
    batch, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if blocks is None:
        index, valid = decode_blocks(block_tables, kv_lens, page_size)
        if window is not None:
            pos = torch.arange(valid.shape[1], device=valid.device)[None, :]
            valid = valid & (pos >= kv_lens[:, None] - window)
    else:  # the caller's mask, window included
        index, valid = blocks
    flat = index.flatten()
    shape = (batch, valid.shape[1], num_kv_heads, head_dim)
    if buffers is None:
        k, v = k_cache.index_select(0, flat), v_cache.index_select(0, flat)
    else:
        k = torch.index_select(k_cache, 0, flat, out=buffers[0][:len(flat)])
        v = torch.index_select(v_cache, 0, flat, out=buffers[1][:len(flat)])
    # The query heads of one KV head become that head's query rows: no K/V repeat.
    qg = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim).float()
    out, lse = attend(qg, k.view(shape).transpose(1, 2).float(),
                      v.view(shape).transpose(1, 2).float(), scale, mask=valid[:, None, None, :])
    out = out.reshape(batch, num_heads, head_dim)
    if return_lse:
        return out, lse.reshape(batch, num_heads)
    return out.to(q.dtype)


@overload
def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, q_start: torch.Tensor, kv_lens: torch.Tensor,
                     scale: float, return_lse: Literal[False] = False,
                     window: int | None = None) -> torch.Tensor: ...
@overload
def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, q_start: torch.Tensor, kv_lens: torch.Tensor,
                     scale: float, return_lse: Literal[True],
                     window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, q_start: torch.Tensor, kv_lens: torch.Tensor,
                     scale: float, return_lse: bool = False, window: int | None = None,
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The new tokens of each sequence attend to its cached prefix and causally to themselves.

    `q`: `[T, num_heads, head_dim]`, sequences packed back to back; sequence b's queries
    are `q[q_start[b]:q_start[b+1]]`, at positions `kv_lens[b] - q_len_b ...
    kv_lens[b] - 1` (their own KV already stored in the cache).
    `window`: a sliding window, the query at position i reading only keys
    i-window+1 .. i (as transformers' `sliding_window_overlay`), or None.
    Returns `[T, num_heads, head_dim]`; with `return_lse`, the fp32 output and its
    log-sum-exp `[T, num_heads]`.
    """
    out = torch.empty(q.shape, dtype=torch.float32 if return_lse else q.dtype, device=q.device)
    lse_out = (torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse
               else None)
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
        if prefix == 0 and (window is None or window >= kv_len):
            o, lse = attend(qb[None], k[None], v[None], scale, causal=True)
        else:
            rows = torch.arange(q_len, device=q.device)[:, None] + prefix
            keys = torch.arange(kv_len, device=q.device)[None, :]
            mask = keys <= rows
            if window is not None:
                mask &= keys > rows - window
            o, lse = attend(qb[None], k[None], v[None], scale, mask=mask)
        out[lo:hi] = o[0].transpose(0, 1)
        if lse_out is not None:
            lse_out[lo:hi] = lse[0].transpose(0, 1)
    return out if lse_out is None else (out, lse_out)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           mask: torch.Tensor | None = None, causal: bool = False,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention that also returns the log-sum-exp of each query's scores.

    `q`: `[B, H, L, D]`, `k`, `v`: `[B, Hkv, S, D]` with H a multiple of Hkv (grouped
    heads read their KV head in place); `mask`: broadcastable to `[B, H, L, S]`, bool (True
    where a query may attend) or an additive bias of q's dtype (0 or -inf, as
    `additive_mask` makes it, for callers that reuse one over many layers); every query
    needs a key. `causal`: L == S, query i sees keys 0..i. Returns the output `[B, H, L, D]`
    and the natural log-sum-exp `[B, H, L]` (fp32). On the CPU this is the flash kernel
    behind `scaled_dot_product_attention` itself (same results, bit for bit), which
    computes the log-sum-exp anyway.
    """
    if mask is not None and mask.dtype == torch.bool:
        mask = additive_mask(mask, q.dtype)
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, is_causal=causal, attn_mask=mask, scale=scale)
    group = q.shape[1] // k.shape[1]
    scores = (q.float() @ k.repeat_interleave(group, 1).float().transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool,
                                               device=q.device).triu(1), float("-inf"))
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, -1)
    out = torch.exp(scores - lse[..., None]) @ v.repeat_interleave(group, 1).float()
    return out.to(q.dtype), lse


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where `mask` is True, -inf elsewhere."""
    zeros = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return zeros.masked_fill_(~mask, float("-inf"))


def cascade_level_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            rows: torch.Tensor, row_offsets: list[int], blocks: torch.Tensor,
                            block_offsets: list[int], scale: float,
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared-run pass of one cascade level: each run's K/V is read once for all the
    query rows that share it.

    Run g: query rows `rows[row_offsets[g]:row_offsets[g+1]]` of `q` (`[T, H, D]`) attend,
    without a mask, to every token of the whole blocks `blocks[block_offsets[g]:
    block_offsets[g+1]]` (all of them lie before every one of those queries). Returns fp32
    `o` `[R, H, D]` and log-sum-exp `[R, H]` for the R = `len(rows)` rows, in `rows` order.
    A run of consecutive block ids is read in place (a slice of the pool), others are
    gathered once for the run.
    """
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    # All queries of one KV head are that head's rows: one product per KV head and run.
    # Packed once for the level (`[Hkv, R, group, D]`), so each run's rows are a view.
    packed = q[rows].view(-1, num_kv_heads, group, head_dim).transpose(0, 1).float().contiguous()
    block_list = blocks.tolist()
    outs, lses = [], []
    for g in range(len(row_offsets) - 1):
        lo, hi = row_offsets[g], row_offsets[g + 1]
        run = block_list[block_offsets[g]:block_offsets[g + 1]]
        if run == list(range(run[0], run[0] + len(run))):
            k, v = k_cache[run[0]:run[0] + len(run)], v_cache[run[0]:run[0] + len(run)]
        else:
            index = blocks[block_offsets[g]:block_offsets[g + 1]]
            k, v = k_cache[index], v_cache[index]
        k = k.flatten(0, 1).transpose(0, 1)[None].float()  # [1, Hkv, S, D]
        v = v.flatten(0, 1).transpose(0, 1)[None].float()
        o, lse = attend(packed[None, :, lo:hi].flatten(2, 3), k, v, scale)
        outs.append(o.view(num_kv_heads, hi - lo, group, head_dim))
        lses.append(lse.view(num_kv_heads, hi - lo, group))
    o = torch.cat(outs, 1).transpose(0, 1).reshape(len(rows), num_heads, head_dim)
    return o, torch.cat(lses, 1).transpose(0, 1).reshape(len(rows), num_heads)


def combine_attention_states(o: torch.Tensor,
                             lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over the union of the keys of P partial states: `o` `[P, ..., D]`,
    `lse` `[P, ...]` (fp32; a part with no keys has lse -inf and contributes nothing; at
    least one part must have keys). Returns `[..., D]` and `[...]`: one softmax over the
    parts' log-sum-exps weighs their outputs, whatever the number of parts."""
    total = torch.logsumexp(lse, 0)
    weights = torch.exp(lse - total)
    return (o * weights[..., None]).sum(0), total


def merge_attention_states_(acc_o: torch.Tensor, acc_lse: torch.Tensor, index: torch.Tensor,
                            o: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold partial attention states into accumulators, in place: rows `index` of `acc_o`
    (`[N, H, D]` fp32) and `acc_lse` (`[N, H]`) become the attention over the union of
    their keys and those of `o`, `lse` (`[R, H, D]`, `[R, H]`; one row per index). A
    log-sum-exp of -inf (no keys) contributes nothing."""
    merged_o, merged_lse = combine_attention_states(torch.stack([acc_o[index], o]),
                                                    torch.stack([acc_lse[index], lse]))
    acc_o[index] = merged_o
    acc_lse[index] = merged_lse
