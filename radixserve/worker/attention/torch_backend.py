"""The `torch` attention backend (the CPU path): the same step in every KV layout, its
reads of the cached keys by block table (`block_reads.py`)."""

from __future__ import annotations

import torch

from radixserve.worker.attention import paged_torch
from radixserve.worker.attention.base import (AttentionBackend, AttentionMetadata, KVLayout,
                                              active_window)
from radixserve.worker.attention.cascade_split import CascadeSplit
from radixserve.worker.attention.block_reads import BlockReads


class TorchAttentionBackend(AttentionBackend):
    """Batched decode for single-token sequences, per-sequence SDPA for the others, and the
    shared-run passes of tree attention merged in by log-sum-exp (on the CPU in fp32, a
    step of decodes and short extends with a plan is one native call per layer, which
    merges: `BlockReads.tree`). Honours sliding windows
    (by masking), but not together with a cascade plan: for a model with a window the
    worker plans one only in steps the window cannot reach. Reads the layout's blocks
    (`KVLayout.layers`) by block table, the same in every layout (`block_reads.py`)."""

    supports_window = True

    def __init__(self, layout: KVLayout | None = None) -> None:
        self.reads = BlockReads()

    def begin_forward(self, meta: AttentionMetadata) -> None:
        super().begin_forward(meta)
        self.split = CascadeSplit(meta)
        self.reads.begin(meta, self.split)
        self.store_index = paged_torch.slot_index(meta.slot_mapping, meta.page_size)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                window: int | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if rope is not None:
            raise ValueError("the torch backend does not fuse RoPE (fuses_rope is False): "
                             "rotate q and k before forward")
        meta, split, reads = self.meta, self.split, self.reads
        window = active_window(meta, window)
        if window is not None and split.levels:
            raise ValueError("tree attention (a cascade plan) cannot honour a sliding window")
        paged_torch.store_kv(k_cache, v_cache, self.store_index, k, v)
        if reads.reads_tree(k_cache):
            return reads.tree(q, k_cache, v_cache, scale).to(q.dtype)
        if split.decode is not None and len(split.decode.seqs) == meta.num_seqs:
            return reads.decode(q, k_cache, v_cache, split.decode, "plain", scale, window)
        out = torch.empty_like(q)
        if split.decode is not None:
            out[split.decode.tokens] = reads.decode(
                q[split.decode.tokens], k_cache, v_cache, split.decode, "plain", scale, window)
        if split.extend is not None:
            out[split.extend.tokens] = reads.extend(q, k_cache, v_cache, split.extend, "plain",
                                                    scale, window)
        if not split.levels:
            return out
        own = []
        if split.own_decode is not None:
            own.append(reads.decode(q[split.own_decode.tokens], k_cache, v_cache,
                                    split.own_decode, "own", scale, window, return_lse=True))
        if split.own_extend is not None:
            own.append(reads.extend(q, k_cache, v_cache, split.own_extend, "own", scale,
                                    window, return_lse=True))
        own_o, own_lse = own[0] if len(own) == 1 else map(torch.cat, zip(*own))
        # Every part's state for every cascaded row (-inf where a level has no run for
        # it), combined by one softmax over the parts.
        parts_o, parts_lse = [own_o], [own_lse]
        for i, level in enumerate(split.levels):
            o, lse = reads.shared_runs(q, k_cache, v_cache, i, scale)
            if not level.in_order:
                o = own_o.new_zeros(own_o.shape).index_copy_(0, level.acc_index, o)
                lse = own_lse.new_full(own_lse.shape, float("-inf")).index_copy_(
                    0, level.acc_index, lse)
            parts_o.append(o)
            parts_lse.append(lse)
        merged, _ = paged_torch.combine_attention_states(torch.stack(parts_o),
                                                         torch.stack(parts_lse))
        out[split.cascade_rows] = merged.to(q.dtype)
        return out
