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
"""

from __future__ import annotations

import torch

from radixserve.kernels import decode_attention
from radixserve.kernels.decode_attention import paged_decode_attention
from radixserve.kernels.extend_attention import extend_attention
from radixserve.kernels.store_kv import store_kv
from radixserve.worker.attention import AttentionBackend, AttentionMetadata


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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        meta = self.meta
        store_kv(k_cache, v_cache, meta.slot_mapping, k, v)
        if self.all_decode:
            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables,
                                          meta.kv_lens, scale, max_kv_len=meta.max_kv_len)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if self.decode_rows is not None:
            out[self.decode_rows] = paged_decode_attention(
                q[self.decode_rows], k_cache, v_cache, self.decode_block_tables,
                self.decode_kv_lens, scale, max_kv_len=meta.max_kv_len)
        extend_attention(q, k_cache, v_cache, self.extend_block_tables, self.extend_q_start,
                         self.extend_kv_lens, scale, max_q_len=meta.max_q_len, out=out,
                         q_lens=self.extend_q_lens)
        return out
