"""The attention-backend interface the model calls, and the torch backend (CPU path).

The model knows this interface only; which backend runs is the worker's choice. A backend
gets the step's `AttentionMetadata` once per forward, then for each layer stores the new
tokens' K/V into the paged cache and returns their attention output.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from radixserve.kernels import reference


@dataclass
class AttentionMetadata:
    """Where each sequence of a flat batch lives in the token stream and in the KV pool."""

    q_start: torch.Tensor
    """`[B+1]` int32: sequence b's tokens are `q_start[b]:q_start[b+1]`."""
    q_lens: torch.Tensor
    """`[B]` int32: new tokens of sequence b this step."""
    kv_lens: torch.Tensor
    """`[B]` int32: cached tokens of sequence b once this step's KV is stored."""
    block_tables: torch.Tensor
    """`[B, max_blocks]` int32: physical blocks of each sequence, in order (padded)."""
    slot_mapping: torch.Tensor
    """`[T]` int64: the slot (block * page_size + offset) of each new token's KV."""
    max_q_len: int
    max_kv_len: int
    page_size: int

    @property
    def num_seqs(self) -> int:
        return self.q_lens.shape[0]


class AttentionBackend(ABC):
    """Paged attention for one forward step."""

    def begin_forward(self, meta: AttentionMetadata) -> None:
        """Called once per step before the first layer: precompute what layers share."""
        self.meta = meta

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """Store `k`, `v` (`[T, Hkv, D]`) at the step's slots, then attend.

        `q`: `[T, H, D]`; returns `[T, H, D]`.
        """


class TorchAttentionBackend(AttentionBackend):
    """Batched decode for single-token sequences, per-sequence SDPA for the others."""

    def __init__(self) -> None:
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None

    def _buffers(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V gather buffers, kept across layers and steps and grown when a step needs
        more: a fresh allocation per layer costs more in page faults than the copy."""
        assert self.decode_blocks is not None
        need = self.decode_blocks[0].numel()
        ws = self._workspace
        if ws is None or ws[0].shape[0] < need or ws[0].dtype != cache.dtype \
                or ws[0].shape[1:] != cache.shape[1:]:
            shape = (max(need, 2 * ws[0].shape[0] if ws else need), *cache.shape[1:])
            ws = (torch.empty(shape, dtype=cache.dtype, device=cache.device),
                  torch.empty(shape, dtype=cache.dtype, device=cache.device))
            self._workspace = ws
        return ws

    def begin_forward(self, meta: AttentionMetadata) -> None:
        super().begin_forward(meta)
        single = meta.q_lens == 1
        self.all_decode = bool(single.all())
        self.decode_seqs = torch.nonzero(single).flatten()
        self.decode_tokens = meta.q_start[:-1][self.decode_seqs].long()
        # Which blocks each decoding sequence reads: the same for all layers.
        self.decode_blocks = reference.decode_blocks(
            meta.block_tables[self.decode_seqs], meta.kv_lens[self.decode_seqs],
            meta.page_size) if len(self.decode_seqs) else None
        self.extend_seqs = torch.nonzero(~single).flatten()
        if len(self.extend_seqs):
            starts = meta.q_start[:-1][self.extend_seqs]
            lens = meta.q_lens[self.extend_seqs]
            self.extend_tokens = torch.cat(
                [torch.arange(int(s), int(s) + int(n)) for s, n in zip(starts, lens)]
            ).to(meta.q_start.device)
            self.extend_q_start = torch.zeros(len(lens) + 1, dtype=torch.int32,
                                              device=lens.device)
            self.extend_q_start[1:] = torch.cumsum(lens, 0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        meta = self.meta
        reference.store_kv(k_cache, v_cache, meta.slot_mapping, k, v)
        if self.all_decode:
            return reference.paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.kv_lens, scale, self.decode_blocks,
                self._buffers(k_cache))
        out = torch.empty_like(q)
        if len(self.decode_seqs):
            seqs = self.decode_seqs
            out[self.decode_tokens] = reference.paged_decode_attention(
                q[self.decode_tokens], k_cache, v_cache, meta.block_tables[seqs],
                meta.kv_lens[seqs], scale, self.decode_blocks, self._buffers(k_cache))
        seqs = self.extend_seqs
        out[self.extend_tokens] = reference.extend_attention(
            q[self.extend_tokens], k_cache, v_cache, meta.block_tables[seqs],
            self.extend_q_start, meta.kv_lens[seqs], scale)
        return out


def create_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto` picks triton on CUDA and torch elsewhere."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from radixserve.worker.attention_triton import TritonAttentionBackend
        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r} (torch, triton or auto)")
