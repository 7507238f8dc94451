"""The attention-backend interface the model calls, and the torch backend (CPU path).

The model knows this interface only; which backend runs is the worker's choice. A backend
gets the step's `AttentionMetadata` once per forward, then for each layer stores the new
tokens' K/V into the paged cache and returns their attention output. A step whose
metadata carries a cascade plan (`worker/cascade.py`) does tree attention: `CascadeSplit`
says, once per step and for both backends, which sequences attend alone, which attend
their own part past their shared runs, and which runs each level reads once per group.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from radixserve.kernels import reference
from radixserve.worker.cascade import CascadePlan


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
    """`[B, max_blocks]` int32: physical blocks of each sequence, in order (padded); in
    the virtual layout, blocks of the slots' views (`VirtualKVPool.view_tables`)."""
    slot_mapping: torch.Tensor
    """`[T]` int64: the slot (block * page_size + offset) of each new token's KV."""
    max_q_len: int
    max_kv_len: int
    page_size: int
    cascade: CascadePlan | None = None
    """The step's shared block runs (tree attention), or None: every sequence alone (its
    block ids named as in `block_tables`)."""
    slots: list[int] | None = None
    """Virtual layout: the slot whose view holds each sequence (`slot_mapping` then
    indexes the slots' views: slot * slot tokens + position); None in the paged layout."""

    @property
    def num_seqs(self) -> int:
        return self.q_lens.shape[0]


@dataclass
class SeqSubset:
    """Some sequences of the step, as the attention functions take them: their token rows,
    and tables and lengths that start at `start` tokens (0, or past their shared runs)."""

    seqs: torch.Tensor
    tokens: torch.Tensor
    """`[T_s]` int64: the subset's rows of the step's token stream, sequence by sequence."""
    block_tables: torch.Tensor
    kv_lens: torch.Tensor
    q_start: torch.Tensor
    """`[S+1]` int32: offsets of each sequence's rows within `tokens`."""

    @classmethod
    def of(cls, meta: AttentionMetadata, seqs: torch.Tensor,
           start: torch.Tensor | None = None) -> "SeqSubset":
        """`seqs` of `meta`, from token `start[i]` (page-aligned) of each, or from 0."""
        q_lens = meta.q_lens[seqs]
        starts = meta.q_start[:-1][seqs]
        tokens = torch.repeat_interleave(starts - _exclusive_cumsum(q_lens), q_lens) \
            + torch.arange(int(q_lens.sum()), device=seqs.device)
        q_start = torch.zeros(len(seqs) + 1, dtype=torch.int32, device=seqs.device)
        q_start[1:] = torch.cumsum(q_lens, 0)
        tables, kv_lens = meta.block_tables[seqs], meta.kv_lens[seqs]
        if start is not None:
            skip = (start // meta.page_size).long()
            cols = torch.arange(tables.shape[1], device=seqs.device)[None, :] + skip[:, None]
            tables = tables.gather(1, cols.clamp(max=tables.shape[1] - 1))
            kv_lens = kv_lens - start.to(kv_lens.dtype)
        return cls(seqs, tokens.long(), tables, kv_lens, q_start)


@dataclass
class CascadeLevelTensors:
    """One cascade level as tensors, in the layout `reference.cascade_level_attention` takes."""

    rows: torch.Tensor
    """`[R]` int64 token rows of the level's runs, run by run."""
    row_offsets: list[int]
    blocks: torch.Tensor
    block_offsets: list[int]
    acc_index: torch.Tensor
    """`[R]`: where each row sits among the cascaded rows (the merge accumulators)."""
    in_order: bool
    """The level's rows are all the cascaded rows, in their order (`acc_index` is 0..R-1)."""


def active_window(meta: AttentionMetadata, window: int | None) -> int | None:
    """`window`, or None when no context of the step is longer than it (then it masks
    nothing: every query reads all its keys)."""
    return None if window is None or window >= meta.max_kv_len else window


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


class AttentionBackend(ABC):
    """Paged attention for one forward step."""

    def begin_forward(self, meta: AttentionMetadata) -> None:
        """Called once per step before the first layer: precompute what layers share."""
        self.meta = meta

    supports_window = False
    """Whether `forward` honours `window` (else the worker picks a backend that does)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                window: int | None = None) -> torch.Tensor:
        """Store `k`, `v` (`[T, Hkv, D]`) at the step's slots, then attend.

        `q`: `[T, H, D]`; returns `[T, H, D]`. `window`: the layer's sliding window (a
        query at position i reads only keys i-window+1 .. i), or None.
        """


class CascadeSplit:
    """What a step's cascade plan means for the attention calls, shared by the backends:
    the sequences attended alone (decodes, extends), those in shared runs (their own parts,
    decodes and extends), and each level's runs, all as tensors built once per step."""

    def __init__(self, meta: AttentionMetadata) -> None:
        dev = meta.q_lens.device
        plan = meta.cascade
        own = torch.tensor(plan.own_start if plan else [0] * meta.num_seqs, device=dev)
        single = meta.q_lens == 1

        def subset(seqs: torch.Tensor, start: bool) -> SeqSubset | None:
            if not len(seqs):
                return None
            return SeqSubset.of(meta, seqs, own[seqs] if start else None)

        lone = own == 0
        self.decode = subset(torch.nonzero(single & lone).flatten(), False)
        self.extend = subset(torch.nonzero(~single & lone).flatten(), False)
        self.own_decode = self.own_extend = None
        self.levels: list[CascadeLevelTensors] = []
        if plan is None:
            return
        # Grouped sequences in the order of the first level's runs (every grouped sequence
        # is in one): in an all-decode step that level's rows are then the accumulators'.
        order = torch.tensor([s for run in plan.levels[0] for s in run.seqs], device=dev)
        self.own_decode = subset(order[single[order]], True)
        self.own_extend = subset(order[~single[order]], True)
        own_rows = [s.tokens for s in (self.own_decode, self.own_extend) if s is not None]
        self.cascade_rows = torch.cat(own_rows)
        position = torch.full((int(meta.q_start[-1]),), -1, dtype=torch.long, device=dev)
        position[self.cascade_rows] = torch.arange(len(self.cascade_rows), device=dev)
        cascade_rows = self.cascade_rows.tolist()
        starts = meta.q_start.tolist()
        for level in plan.levels:
            rows, row_offsets, blocks, block_offsets = [], [0], [], [0]
            for run in level:
                for seq in run.seqs:
                    rows.extend(range(starts[seq], starts[seq + 1]))
                row_offsets.append(len(rows))
                blocks.extend(run.blocks)
                block_offsets.append(len(blocks))
            rows_t = torch.tensor(rows, dtype=torch.long, device=dev)
            self.levels.append(CascadeLevelTensors(
                rows_t, row_offsets, torch.tensor(blocks, dtype=torch.long, device=dev),
                block_offsets, position[rows_t], rows == cascade_rows))


class TorchAttentionBackend(AttentionBackend):
    """Batched decode for single-token sequences, per-sequence SDPA for the others, and the
    shared-run passes of tree attention merged in by log-sum-exp. Honours sliding windows
    (by masking: every cached block is still read), but not together with a cascade plan:
    for a model with a window the worker plans one only in steps the window cannot reach."""

    supports_window = True

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

    def begin_forward(self, meta: AttentionMetadata) -> None:
        super().begin_forward(meta)
        self.split = split = CascadeSplit(meta)
        # Which blocks each batch of decodes reads, and its padding mask as an additive
        # bias: the same for all layers, so made once here. The two batches (plain, own
        # parts) use the one workspace one after the other.
        self.decode_blocks = {}
        self._valid = {}
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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                window: int | None = None) -> torch.Tensor:
        meta, split = self.meta, self.split
        window = active_window(meta, window)
        if window is not None and split.levels:
            raise ValueError("tree attention (a cascade plan) cannot honour a sliding window")
        self.window = window
        reference.store_kv(k_cache, v_cache, meta.slot_mapping, k, v)
        if split.decode is not None and len(split.decode.seqs) == meta.num_seqs:
            return self._decode(q, k_cache, v_cache, split.decode, "plain", scale)
        out = torch.empty_like(q)
        if split.decode is not None:
            out[split.decode.tokens] = self._decode(
                q[split.decode.tokens], k_cache, v_cache, split.decode, "plain", scale)
        if split.extend is not None:
            out[split.extend.tokens] = self._extend(q, k_cache, v_cache, split.extend, scale)
        if not split.levels:
            return out
        own = []
        if split.own_decode is not None:
            own.append(self._decode(q[split.own_decode.tokens], k_cache, v_cache,
                                    split.own_decode, "own", scale, return_lse=True))
        if split.own_extend is not None:
            own.append(self._extend(q, k_cache, v_cache, split.own_extend, scale,
                                    return_lse=True))
        own_o, own_lse = own[0] if len(own) == 1 else map(torch.cat, zip(*own))
        # Every part's state for every cascaded row (-inf where a level has no run for
        # it), combined by one softmax over the parts.
        parts_o, parts_lse = [own_o], [own_lse]
        for i, level in enumerate(split.levels):
            o, lse = self._shared_runs(q, k_cache, v_cache, i, scale)
            if not level.in_order:
                o = own_o.new_zeros(own_o.shape).index_copy_(0, level.acc_index, o)
                lse = own_lse.new_full(own_lse.shape, float("-inf")).index_copy_(
                    0, level.acc_index, lse)
            parts_o.append(o)
            parts_lse.append(lse)
        merged, _ = reference.combine_attention_states(torch.stack(parts_o), torch.stack(parts_lse))
        out[split.cascade_rows] = merged.to(q.dtype)
        return out

    def _shared_runs(self, q, k_cache, v_cache, level: int, scale: float):
        """Level `level`'s shared-run pass: fp32 output and log-sum-exp of its rows."""
        t = self.split.levels[level]
        return reference.cascade_level_attention(q, k_cache, v_cache, t.rows, t.row_offsets,
                                                 t.blocks, t.block_offsets, scale)

    def _decode(self, q, k_cache, v_cache, subset: SeqSubset, name: str, scale: float,
                return_lse: bool = False):
        blocks = self.decode_blocks[name] if self.window is None else \
            self._window_blocks(name, self.window)
        return reference.paged_decode_attention(
            q, k_cache, v_cache, subset.block_tables, subset.kv_lens, scale, blocks,
            self._buffers(k_cache, blocks[0].numel()), return_lse=return_lse)

    def _extend(self, q, k_cache, v_cache, subset: SeqSubset, scale: float,
                return_lse: bool = False):
        return reference.extend_attention(q[subset.tokens], k_cache, v_cache,
                                          subset.block_tables, subset.q_start, subset.kv_lens,
                                          scale, return_lse=return_lse, window=self.window)


def create_backend(name: str, device: torch.device,
                   kv_layout: str = "paged") -> AttentionBackend:
    """`auto` picks triton on CUDA and torch elsewhere; each has a version for the virtual
    layout's views."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    virtual = kv_layout == "virtual"
    if name == "torch":
        if virtual:
            from radixserve.worker.attention_virtual import VirtualAttentionBackend
            return VirtualAttentionBackend()
        return TorchAttentionBackend()
    if name == "triton":
        from radixserve.worker.attention_triton import (TritonAttentionBackend,
                                                        VirtualTritonBackend)
        return VirtualTritonBackend() if virtual else TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r} (torch, triton or auto)")
