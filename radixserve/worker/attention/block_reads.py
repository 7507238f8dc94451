"""How the torch backend reads a step's cached K/V, by block table, in every layout:
decodes, short extends and tree attention's shared runs read the blocks in place
(`radixserve.native.decode_attention`, fp32 on the CPU), every other call gathers the
blocks it reads."""

from __future__ import annotations

from typing import Literal, overload

import torch

import radixserve.native as native
from radixserve.worker.attention import paged_torch
from radixserve.worker.attention.base import AttentionMetadata
from radixserve.worker.attention.cascade_split import CascadeSplit, SeqSubset

NATIVE_EXTEND_ROWS = 9
"""Longest extend read in place: each row reads its sequence's keys again (from cache),
which beat gathering them and running SDPA at 5 and 9 rows (1.4-6x, contexts 256-4096,
batch 1 and 8, on a busy 2-core Xeon), not always at 17 (0.6-8x)."""

Attended = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""`[T, H, D]` output in q's dtype, or with `return_lse` the fp32 output and `[T, H]`
log-sum-exp."""

NativeArgs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""The native decode's block tables, first keys and key counts, one row per query."""


class BlockReads:
    """Decodes and shared runs read in place where the native kernel reads the cache,
    else decodes batched over gathered blocks (padded and masked) and each shared run
    gathered once; per-sequence SDPA for long extends. Sliding windows: the native decode
    reads only the window's keys, the others mask (every cached block is still read)."""

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
        """Once per step, before the first layer."""
        self.split, self.page_size = split, meta.page_size
        # What each batch of decodes (plain, own parts) reads is the same for all layers:
        # made on the first layer's call, per window, then reused.
        self._per_step: dict[tuple[str, int | None, bool], NativeArgs] = {}
        self._masks: dict[tuple[str, int | None, bool], tuple[torch.Tensor, torch.Tensor]] = {}
        self._runs: dict[int, tuple[NativeArgs, torch.Tensor]] = {}
        self._tree: tuple[NativeArgs, torch.Tensor, torch.Tensor] | None = None
        self._short_extends = all(
            s is None or int(s.q_start.diff().max()) <= NATIVE_EXTEND_ROWS
            for s in (split.extend, split.own_extend)) if split.levels else False

    def _native_args(self, subset: SeqSubset, name: str,
                     window: int | None) -> NativeArgs:
        """The native decode's tables, first keys and lengths."""
        key = (name, window, True)
        if key not in self._per_step:
            lens = subset.kv_lens.long()
            starts = torch.zeros_like(lens) if window is None else (lens - window).clamp(min=0)
            self._per_step[key] = (subset.block_tables.contiguous(), starts, lens)
        return self._per_step[key]

    def _gather_blocks(self, subset: SeqSubset, name: str,
                       window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks the gathered decode reads and its padding mask (the window's keys
        only) as an additive bias."""
        key = (name, window, False)
        if key not in self._masks:
            index, valid = paged_torch.decode_blocks(subset.block_tables, subset.kv_lens,
                                                   self.page_size)
            if window is not None:
                pos = torch.arange(valid.shape[1], device=valid.device)[None, :]
                valid = valid & (pos >= subset.kv_lens[:, None] - window)
            self._masks[key] = (index, paged_torch.additive_mask(valid, torch.float32))
        return self._masks[key]

    @overload
    def decode(self, q, k_cache, v_cache, subset: SeqSubset, name: str, scale: float,
               window: int | None, return_lse: Literal[False] = False) -> torch.Tensor: ...
    @overload
    def decode(self, q, k_cache, v_cache, subset: SeqSubset, name: str, scale: float,
               window: int | None, return_lse: bool = False) -> Attended: ...

    def decode(self, q, k_cache, v_cache, subset: SeqSubset, name: str, scale: float,
               window: int | None, return_lse: bool = False) -> Attended:
        """Single-token sequences `subset` (`name`: "plain", the split's `decode`, or
        "own", its `own_decode`), `q` their rows."""
        if native.decode_attention_fits(k_cache):
            out, lse = native.decode_attention(q, k_cache, v_cache,
                                               *self._native_args(subset, name, window), scale)
            return (out, lse) if return_lse else out.to(q.dtype)
        blocks = self._gather_blocks(subset, name, window)
        return paged_torch.paged_decode_attention(
            q, k_cache, v_cache, subset.block_tables, subset.kv_lens, scale, blocks,
            self._buffers(k_cache, blocks[0].numel()), return_lse=return_lse)

    def _row_args(self, subset: SeqSubset, name: str, window: int | None) -> NativeArgs:
        """A short extend's rows as single-token queries for the native decode: each row
        its sequence's table, its own causal length and first key."""
        key = (f"{name} extend", window, True)
        if key not in self._per_step:
            q_lens = subset.q_start.diff().long()
            seq = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)
            after = subset.q_start[1:].long()[seq] - 1 - torch.arange(len(seq))
            lens = subset.kv_lens.long()[seq] - after  # keys up to and including the row's
            starts = torch.zeros_like(lens) if window is None else (lens - window).clamp(min=0)
            self._per_step[key] = (subset.block_tables[seq].contiguous(), starts, lens)
        return self._per_step[key]

    @overload
    def extend(self, q, k_cache, v_cache, subset: SeqSubset, name: str, scale: float,
               window: int | None, return_lse: Literal[False] = False) -> torch.Tensor: ...
    @overload
    def extend(self, q, k_cache, v_cache, subset: SeqSubset, name: str, scale: float,
               window: int | None, return_lse: bool = False) -> Attended: ...

    def extend(self, q, k_cache, v_cache, subset: SeqSubset, name: str, scale: float,
               window: int | None, return_lse: bool = False) -> Attended:
        """Multi-token sequences `subset` (`name`: "plain", the split's `extend`, or "own",
        its `own_extend`), `q` the step's rows (all of them), causally. Extends of at most
        `NATIVE_EXTEND_ROWS` rows each (a speculative step's drafts, a prompt's last few
        tokens) read the blocks in place, each row as a decode of its own length."""
        if (native.decode_attention_fits(k_cache)
                and int(subset.q_start.diff().max()) <= NATIVE_EXTEND_ROWS):
            out, lse = native.decode_attention(q[subset.tokens], k_cache, v_cache,
                                               *self._row_args(subset, name, window), scale)
            return (out, lse) if return_lse else out.to(q.dtype)
        return paged_torch.extend_attention(q[subset.tokens], k_cache, v_cache,
                                          subset.block_tables, subset.q_start, subset.kv_lens,
                                          scale, return_lse=return_lse, window=window)

    def _level_args(self, level: int) -> tuple[NativeArgs, torch.Tensor]:
        """Cascade level `level`'s runs as the native kernel's key sets: one table row per
        run (its blocks, padded), all of its tokens, and its query rows' offsets."""
        if level not in self._runs:
            t = self.split.levels[level]
            blocks = torch.tensor(t.block_offsets).diff()
            tables = torch.zeros(len(blocks), int(blocks.max()), dtype=torch.int32)
            tables[torch.arange(tables.shape[1])[None, :] < blocks[:, None]] = t.blocks.int()
            lens = blocks * self.page_size
            self._runs[level] = ((tables, torch.zeros_like(lens), lens),
                                 torch.tensor(t.row_offsets))
        return self._runs[level]

    def reads_tree(self, k_cache: torch.Tensor) -> bool:
        """Whether this step's tree attention is one native call per layer (`tree`): it has
        a plan, the native kernel reads the cache, and its extends are short enough to be
        read as decodes (`NATIVE_EXTEND_ROWS`)."""
        return self._short_extends and native.decode_attention_fits(k_cache)

    def tree(self, q, k_cache, v_cache, scale: float) -> torch.Tensor:
        """A step with a cascade plan in one native call: each row reads its whole context
        (a sequence in no run) or its own part, and the runs of its group, each run once
        for all its rows; the kernel merges each row's parts. The fp32 output of every
        row of the step."""
        if self._tree is None:
            self._tree = self._tree_args()
        args, row_offsets, rows = self._tree
        return native.decode_attention(q, k_cache, v_cache, *args, scale, row_offsets,
                                       rows)[0]

    def _tree_args(self) -> tuple[NativeArgs, torch.Tensor, torch.Tensor]:
        """`tree`'s key sets: the decodes' and short extends' rows one set each (plain,
        then own parts), then each level's runs; each set's rows by offsets into `rows`."""
        split = self.split
        parts = []  # (tables, starts, lens), the sets' rows, rows per set
        for subset, name, extend in ((split.decode, "plain", False), (split.extend, "plain", True),
                                     (split.own_decode, "own", False),
                                     (split.own_extend, "own", True)):
            if subset is not None:
                args = (self._row_args(subset, name, None) if extend
                        else self._native_args(subset, name, None))
                parts.append((args, subset.tokens, torch.ones(len(subset.tokens),
                                                              dtype=torch.long)))
        for level, t in enumerate(split.levels):
            args, row_offsets = self._level_args(level)
            parts.append((args, t.rows, row_offsets.diff()))
        width = max(args[0].shape[1] for args, _, _ in parts)
        tables = torch.cat([torch.nn.functional.pad(args[0], (0, width - args[0].shape[1]))
                            for args, _, _ in parts])
        starts, lens = (torch.cat([args[i] for args, _, _ in parts]) for i in (1, 2))
        counts = torch.cat([c for _, _, c in parts])
        offsets = torch.zeros(len(counts) + 1, dtype=torch.long)
        offsets[1:] = counts.cumsum(0)
        return (tables, starts, lens), offsets, torch.cat([rows for _, rows, _ in parts])

    def shared_runs(self, q, k_cache, v_cache, level: int,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Cascade level `level`'s shared-run pass: fp32 output and log-sum-exp of its
        rows (`CascadeLevelTensors.rows`), each run read once for all its rows."""
        t = self.split.levels[level]
        if native.decode_attention_fits(k_cache):
            args, row_offsets = self._level_args(level)
            return native.decode_attention(q[t.rows], k_cache, v_cache, *args, scale,
                                           row_offsets)
        return paged_torch.cascade_level_attention(q, k_cache, v_cache, t.rows, t.row_offsets,
                                                 t.blocks, t.block_offsets, scale)
