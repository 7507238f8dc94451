"""The `triton` attention backend: the paged Triton kernels behind the worker's interface.

Same contract as `TorchAttentionBackend`: each layer's `forward` stores the step's K/V at
`meta.slot_mapping`, then attends. An all-decode step (every sequence has one new token)
runs the paged decode kernel (GQA-packed, split-KV when contexts are long). A mixed step
runs the extend kernel over the multi-token sequences only (their rows addressed in place
through per-sequence starts and lengths, so its grid does not grow with the number of
decodes) and the decode kernel over the single-token ones (their q rows gathered), so
decodes in a mixed batch still read each KV head once instead of once per query head.
What layers share (the two subsets' tables and lengths) is computed once in
`begin_forward`.

A step with a cascade plan (`meta.cascade`, tree attention) runs as the torch backend
does, on the same `CascadeSplit`: the sequences in no shared run as above, the grouped
ones' own parts (decode and extend kernels with `return_lse`, written straight into fp32
merge accumulators), then per level one launch of `cascade_level_attention` over all its
runs and one `merge_attention_states_` into the accumulators, which are finally cast into
the output rows. A step without a plan takes the plain path, untouched.

Sliding windows (`window`, per layer) reach the decode and extend kernels, which read only
the keys in the window; tree attention's shared-run passes have none, so for a model with
a window the worker plans a cascade only in steps whose contexts all fit it.
"""

from __future__ import annotations

import torch

from radixserve.kernels import decode_attention
from radixserve.kernels.cascade_attention import (RunOffsets, cascade_level_attention,
                                                  merge_attention_states_, run_offsets)
from radixserve.kernels.decode_attention import paged_decode_attention
from radixserve.kernels.extend_attention import extend_attention
from radixserve.kernels.store_kv import store_kv
from radixserve.worker.attention import (AttentionBackend, AttentionMetadata,
                                         CascadeLevelTensors, CascadeSplit, active_window)


def interpreting() -> bool:
    """Whether the kernels were built for the Triton interpreter (`TRITON_INTERPRET=1` at
    import time), the only way they run on a CPU."""
    return type(decode_attention._decode_kernel).__name__ == "InterpretedFunction"


class TritonAttentionBackend(AttentionBackend):
    """Paged decode for single-token sequences, paged extend for the others (Triton).

    Needs: `block_tables` int32/int64 rows listing at least each sequence's used blocks
    (padding entries are never read), `kv_lens >= 1`, `max_q_len`/`max_kv_len` upper
    bounds of the batch's query and KV lengths, and q/k/v/caches with a contiguous
    head_dim axis (other strides are free).
    """

    def begin_forward(self, meta: AttentionMetadata) -> None:
        super().begin_forward(meta)
        if meta.q_start.device.type != "cuda" and not interpreting():
            raise RuntimeError("the triton attention backend runs on CUDA, or on the CPU only "
                               "with TRITON_INTERPRET=1 set before radixserve.kernels is "
                               "imported")
        self.cascade: _CascadeStep | None = None
        if meta.cascade is not None:
            self.all_decode = False
            self.cascade = _CascadeStep(meta, self.contiguous)
            return
        num_tokens = int(meta.slot_mapping.shape[0])
        self.all_decode = meta.max_q_len == 1 and num_tokens == meta.num_seqs
        self.decode_rows: torch.Tensor | None = None
        self.extend_q_lens: torch.Tensor | None = None
        if self.all_decode:
            return
        self.extend_q_start, self.extend_kv_lens = meta.q_start, meta.kv_lens
        self.extend_block_tables = meta.block_tables
        single = meta.q_lens == 1
        seqs = torch.nonzero(single).flatten()
        if len(seqs) == 0:
            return
        self.decode_rows = meta.q_start[:-1][seqs].long()
        self.decode_block_tables = meta.block_tables[seqs]
        self.decode_kv_lens = meta.kv_lens[seqs]
        seqs = torch.nonzero(~single).flatten()
        self.extend_q_start = meta.q_start[:-1][seqs]
        self.extend_q_lens = meta.q_lens[seqs]
        self.extend_kv_lens = meta.kv_lens[seqs]
        self.extend_block_tables = meta.block_tables[seqs]

    supports_window = True
    contiguous = False
    """Each sequence's table (and each shared run) is consecutive block ids over caches
    whose blocks lie back to back (the virtual layout's views): the kernels then read
    only the first id (`kernels/_common.token_blocks`)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                window: int | None = None) -> torch.Tensor:
        meta = self.meta
        window = active_window(meta, window)
        store_kv(k_cache, v_cache, meta.slot_mapping, k, v)
        if self.all_decode:
            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables,
                                          meta.kv_lens, scale, max_kv_len=meta.max_kv_len,
                                          window=window, contiguous=self.contiguous)
        if self.cascade is not None:
            if window is not None:
                raise ValueError("tree attention (a cascade plan) cannot honour a sliding "
                                 "window")
            return self.cascade.forward(meta, q, k_cache, v_cache, scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if self.decode_rows is not None:
            out[self.decode_rows] = paged_decode_attention(
                q[self.decode_rows], k_cache, v_cache, self.decode_block_tables,
                self.decode_kv_lens, scale, max_kv_len=meta.max_kv_len, window=window,
                contiguous=self.contiguous)
        extend_attention(q, k_cache, v_cache, self.extend_block_tables, self.extend_q_start,
                         self.extend_kv_lens, scale, max_q_len=meta.max_q_len, out=out,
                         q_lens=self.extend_q_lens, window=window, contiguous=self.contiguous)
        return out


class _CascadeStep:
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
        self.own_decode_max_kv = 0 if own is None else int(own.kv_lens.max())
        self.levels: list[tuple[CascadeLevelTensors, RunOffsets]] = [
            (level, run_offsets(level.row_offsets, level.block_offsets, dev))
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


class VirtualTritonBackend(TritonAttentionBackend):
    """The Triton backend's step over the virtual layout's views (`worker/virtual_kv.py`),
    seen as a pool of `page_size` blocks back to back: there the metadata's block ids
    (`Worker._prepare`: slot * slot_blocks + position) are consecutive for each sequence
    and shared run, so each one's KV is one contiguous range the kernels read from its
    first id."""

    contiguous = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                window: int | None = None) -> torch.Tensor:
        page = self.meta.page_size
        return super().forward(q, k, v, k_cache.view(-1, page, *k_cache.shape[2:]),
                               v_cache.view(-1, page, *v_cache.shape[2:]), scale, window)
