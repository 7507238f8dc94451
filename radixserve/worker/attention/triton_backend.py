"""The `triton` attention backend: the paged Triton kernels behind the worker's interface.

Same contract as `torch_backend.TorchAttentionBackend`: each layer's `forward` stores the
step's K/V at `meta.slot_mapping`, then attends. An all-decode step (every sequence has one new
token) runs the paged decode kernel (GQA-packed, split-KV when contexts are long). A mixed step
runs the extend kernel over the multi-token sequences only (their rows addressed in place
through per-sequence starts and lengths, so its grid does not grow with the number of
decodes) and the decode kernel over the single-token ones (their q rows gathered), so
decodes in a mixed batch still read each KV head once instead of once per query head.
What layers share (the two subsets' tables and lengths) is computed once in
`begin_forward`.

A step with a cascade plan (`meta.cascade`, tree attention) runs in `triton_cascade.py`.
A step without a plan takes the plain path, untouched.

In the virtual layout the caches are the slots' views seen as blocks back to back, where
each sequence's block ids are consecutive (`KVLayout.contiguous`): the kernels read each
sequence's KV as one range from its first block id, with no block table walked.

Sliding windows (`window`, per layer) reach the decode and extend kernels, which read only
the keys in the window; tree attention's shared-run passes have none, so for a model with
a window the worker plans a cascade only in steps whose contexts all fit it.
"""

from __future__ import annotations

import torch

from radixserve.kernels import decode_attention
from radixserve.kernels.decode_attention import paged_decode_attention
from radixserve.kernels.extend_attention import extend_attention
from radixserve.kernels.fused import rope_store_kv
from radixserve.kernels.store_kv import store_kv
from radixserve.worker.attention.base import (AttentionBackend, AttentionMetadata, KVLayout,
                                              active_window)
from radixserve.worker.attention.triton_cascade import TritonCascadeStep


def interpreting() -> bool:
    """Whether the kernels were built for the Triton interpreter (`TRITON_INTERPRET=1` at
    import time), the only way they run on a CPU."""
    return type(decode_attention._decode_kernel).__name__ == "InterpretedFunction"


class TritonAttentionBackend(AttentionBackend):
    """Paged decode for single-token sequences, paged extend for the others (Triton).

    Needs: `block_tables` int32/int64 rows listing at least each sequence's used blocks
    (padding entries are never read), `kv_lens >= 1`, `max_q_len`/`max_kv_len` upper
    bounds of the batch's query and KV lengths, and q/k/v/caches with a contiguous
    head_dim axis (other strides are free). Reads the layout's caches as blocks
    (`KVLayout.block_layers`).
    """

    def __init__(self, layout: KVLayout | None = None) -> None:
        self.contiguous = layout is not None and layout.contiguous
        """Each sequence's table (and each shared run) is consecutive block ids over
        blocks back to back (the virtual layout's views): the kernels then read only the
        first id (`kernels/_common.token_blocks`)."""

    def begin_forward(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        if meta.q_start.device.type != "cuda" and not interpreting():
            raise RuntimeError("the triton attention backend runs on CUDA, or on the CPU only "
                               "with TRITON_INTERPRET=1 set before radixserve.kernels is "
                               "imported")
        self.cascade: TritonCascadeStep | None = None
        if meta.cascade is not None:
            self.all_decode = False
            self.cascade = TritonCascadeStep(meta, self.contiguous)
            return
        num_tokens = int(meta.slot_mapping.shape[0])
        self.all_decode = meta.max_q_len == 1 and num_tokens == meta.num_seqs
        self.decode_rows: torch.Tensor | None = None
        self.extend_q_lens: torch.Tensor | None = None
        if self.all_decode:
            return
        self.extend_q_start, self.extend_kv_lens = meta.q_start, meta.kv_lens
        self.extend_block_tables = meta.block_tables
        kinds = meta.seq_kinds()  # sized on the host: no sync
        if len(kinds.decode) == 0:
            return
        seqs = kinds.decode
        self.decode_rows = meta.q_start[:-1][seqs].long()
        self.decode_block_tables = meta.block_tables[seqs]
        self.decode_kv_lens = meta.kv_lens[seqs]
        seqs = kinds.extend
        self.extend_q_start = meta.q_start[:-1][seqs]
        self.extend_q_lens = meta.q_lens[seqs]
        self.extend_kv_lens = meta.kv_lens[seqs]
        self.extend_block_tables = meta.block_tables[seqs]

    supports_window = True
    graph_capturable = True
    fuses_rope = True

    @property
    def timed_natively(self) -> bool:  # type: ignore[override]
        return not interpreting()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                window: int | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        meta = self.meta
        window = active_window(meta, window)
        if rope is None:
            store_kv(k_cache, v_cache, meta.slot_mapping, k, v)
        else:  # the kernels below read the new tokens' K from the cache alone
            rope_store_kv(q, k, v, *rope, k_cache, v_cache, meta.slot_mapping)
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
