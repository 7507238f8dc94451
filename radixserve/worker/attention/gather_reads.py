"""The torch backend's reads by block table: each call gathers the blocks it reads."""

from __future__ import annotations

import torch

from radixserve.kernels import reference
from radixserve.worker.attention.base import AttentionMetadata
from radixserve.worker.attention.cascade_split import CascadeSplit, SeqSubset
from radixserve.worker.attention.reads import Attended, KVReads


class GatherReads(KVReads):
    """Batched decode over gathered blocks (padded and masked), per-sequence SDPA for
    extends, and each shared run gathered once. Sliding windows by masking: every cached
    block is still read."""

    def __init__(self) -> None:
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None

    def _buffers(self, cache: torch.Tensor, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V gather buffers, kept across layers and steps and grown when a step needs
        more: a fresh allocation per layer costs more in page faults than the copy."""
        ws = self._workspace
        if ws is None or ws[0].shape[0] < need or ws[0].dtype != cache.dtype \
                or ws[0].shape[1:] != cache.shape[1:]:
            shape = (max(need, 2 * ws[0].shape[0] if ws else need), *cache.shape[1:])
            ws = (torch.empty(shape, dtype=cache.dtype, device=cache.device),
                  torch.empty(shape, dtype=cache.dtype, device=cache.device))
            self._workspace = ws
        return ws

    def begin(self, meta: AttentionMetadata, split: CascadeSplit) -> None:
        self.split = split
        # Which blocks each batch of decodes reads, and its padding mask as an additive
        # bias: the same for all layers, so made once here. The two batches (plain, own
        # parts) use the one workspace one after the other.
        self.decode_blocks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._valid: dict[str, torch.Tensor] = {}
        for name, s in (("plain", split.decode), ("own", split.own_decode)):
            if s is not None:
                index, valid = reference.decode_blocks(s.block_tables, s.kv_lens, meta.page_size)
                self.decode_blocks[name] = (index, reference.additive_mask(valid, torch.float32))
                self._valid[name] = valid

    def _window_blocks(self, name: str, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode_blocks[name]` with its mask narrowed to the last `window` keys of each
        sequence, made once per step and window."""
        key = f"{name}@{window}"
        if key not in self.decode_blocks:
            index, _ = self.decode_blocks[name]
            valid = self._valid[name]
            subset = self.split.decode if name == "plain" else self.split.own_decode
            pos = torch.arange(valid.shape[1], device=valid.device)[None, :]
            valid = valid & (pos >= subset.kv_lens[:, None] - window)
            self.decode_blocks[key] = (index, reference.additive_mask(valid, torch.float32))
        return self.decode_blocks[key]

    def decode(self, q, k_cache, v_cache, subset: SeqSubset, name: str, scale: float,
               window: int | None, return_lse: bool = False) -> Attended:
        blocks = self.decode_blocks[name] if window is None else \
            self._window_blocks(name, window)
        return reference.paged_decode_attention(
            q, k_cache, v_cache, subset.block_tables, subset.kv_lens, scale, blocks,
            self._buffers(k_cache, blocks[0].numel()), return_lse=return_lse)

    def extend(self, q, k_cache, v_cache, subset: SeqSubset, scale: float,
               window: int | None, return_lse: bool = False) -> Attended:
        return reference.extend_attention(q[subset.tokens], k_cache, v_cache,
                                          subset.block_tables, subset.q_start, subset.kv_lens,
                                          scale, return_lse=return_lse, window=window)

    def shared_runs(self, q, k_cache, v_cache, level: int, scale: float):
        t = self.split.levels[level]
        return reference.cascade_level_attention(q, k_cache, v_cache, t.rows, t.row_offsets,
                                                 t.blocks, t.block_offsets, scale)
