"""Tree attention on the Triton kernels: a step with a cascade plan (`meta.cascade`).

It runs as the torch backend does, on the same `CascadeSplit`: the sequences in no shared
run as on the plain path, the grouped ones' own parts (decode and extend kernels with
`return_lse`, written straight into fp32 merge accumulators), then per level one launch of
`cascade_level_attention` over all its runs and one `merge_attention_states_` into the
accumulators, which are finally cast into the output rows.
"""

from __future__ import annotations

import torch

from radixserve.kernels.cascade_attention import (RunOffsets, cascade_level_attention,
                                                  merge_attention_states_, run_offsets)
from radixserve.kernels.decode_attention import paged_decode_attention
from radixserve.kernels.extend_attention import extend_attention
from radixserve.worker.attention.base import AttentionMetadata
from radixserve.worker.attention.cascade_split import CascadeLevelTensors, CascadeSplit
from radixserve.worker.staging import to_device


class TritonCascadeStep:
    """A step with tree attention: its `CascadeSplit`, and what the kernels need beyond
    it (in-place addressing of the plain extends, the levels' run offsets on the device,
    the own decodes' longest context), computed once for all layers."""

    def __init__(self, meta: AttentionMetadata, contiguous: bool) -> None:
        self.contiguous = contiguous
        self.split = split = CascadeSplit(meta)
        dev = meta.q_lens.device
        if split.extend is not None:  # addressed in place, as on the plain path
            self.extend_q_start = meta.q_start[:-1][split.extend.seqs]
            self.extend_q_lens = meta.q_lens[split.extend.seqs]
        own = split.own_decode
        self.num_own_decodes = 0 if own is None else len(own.seqs)
        # The own parts are short next to the shared runs: their own bound keeps the
        # decode kernel from splitting them on the whole context's account.
        self.own_decode_max_kv = 0 if own is None else own.max_kv_len
        self.levels: list[tuple[CascadeLevelTensors, RunOffsets]] = [
            (level, run_offsets(level.row_offsets, level.block_offsets, dev, to_device))
            for level in split.levels]

    def forward(self, meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        split = self.split
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if split.decode is not None:
            rows = split.decode.tokens
            out[rows] = paged_decode_attention(q[rows], k_cache, v_cache,
                                               split.decode.block_tables, split.decode.kv_lens,
                                               scale, max_kv_len=meta.max_kv_len,
                                               contiguous=self.contiguous)
        if split.extend is not None:
            extend_attention(q, k_cache, v_cache, split.extend.block_tables, self.extend_q_start,
                             split.extend.kv_lens, scale, max_q_len=meta.max_q_len, out=out,
                             q_lens=self.extend_q_lens, contiguous=self.contiguous)
        # Merge accumulators, one row per cascaded token (own decodes, then own extends):
        # the own parts' fp32 states are written into them in place.
        num_rows, nd = len(split.cascade_rows), self.num_own_decodes
        acc_o = torch.empty((num_rows, *q.shape[1:]), dtype=torch.float32, device=q.device)
        acc_lse = torch.empty((num_rows, q.shape[1]), dtype=torch.float32, device=q.device)
        if split.own_decode is not None:
            own = split.own_decode
            paged_decode_attention(q[own.tokens], k_cache, v_cache, own.block_tables,
                                   own.kv_lens, scale, max_kv_len=self.own_decode_max_kv,
                                   out=acc_o[:nd], lse_out=acc_lse[:nd], return_lse=True,
                                   contiguous=self.contiguous)
        if split.own_extend is not None:
            own = split.own_extend
            extend_attention(q[own.tokens], k_cache, v_cache, own.block_tables, own.q_start,
                             own.kv_lens, scale, max_q_len=meta.max_q_len, out=acc_o[nd:],
                             lse_out=acc_lse[nd:], return_lse=True, contiguous=self.contiguous)
        for level, offsets in self.levels:
            o, lse = cascade_level_attention(q, k_cache, v_cache, level.rows, level.row_offsets,
                                             level.blocks, level.block_offsets, scale,
                                             offsets=offsets, contiguous=self.contiguous)
            merge_attention_states_(acc_o, acc_lse, level.acc_index, o, lse)
        out[split.cascade_rows] = acc_o.to(q.dtype)
        return out
