"""The `torch` attention backend (the CPU path): the same step in every KV layout, reading
the cached K/V by block table (`KVLayout.layers`).

Where the native kernel reads the cache (`radixserve.native.decode_attention`, fp32 on the
CPU), a step is one native call a layer over key sets read in place: a decode's context,
an extend's rows causally in blocks (`_causal_sets`), tree attention's shared runs. Else the
blocks a call reads are gathered (`paged_torch.py`): decodes batched over gathered blocks
(padded and masked), each shared run gathered once, per-sequence SDPA for extends. Sliding
windows: the native decode reads only the window's keys (extends of at most
`WINDOW_EXTEND_ROWS` rows; longer ones by SDPA), the others mask (every cached block is
still read). A step with a plan and no native kernel (`cascade_split.CascadeSplit`, built
once for its layers) splits its sequences by part.
"""

from __future__ import annotations

from typing import Literal, Protocol, overload

import torch

import radixserve.native as native
from radixserve.worker.attention import paged_torch
from radixserve.worker.attention.base import (AttentionBackend, AttentionMetadata, KVLayout,
                                              active_window)
from radixserve.worker.attention.cascade_split import CascadeSplit, SeqSubset

WINDOW_EXTEND_ROWS = 9
"""Longest extend read in place under a sliding window, where each row is a set of keys of
its own (`_causal_sets`): that beat gathering them and running SDPA at 5 and 9 rows
(1.4-6x, contexts 256-4096, batch 1 and 8, on a busy 2-core Xeon), not always at 17."""

CAUSAL_BLOCK = 16
"""Rows of an extend that read their common keys as one set (`_causal_sets`): the lane
kernel scores a key for all of their queries at once. Against SDPA on the default model's
heads (2 cores, Zen 4): a 512-token prompt 2.0x, 512 new tokens after 1.5k-3.5k cached
1.3-1.4x, 2-16 new tokens after 0.5k-2k 1.0-1.7x faster than one set per row; 16 or 64
rows a block ran alike."""

Attended = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""`[T, H, D]` output in q's dtype, or with `return_lse` the fp32 output and `[T, H]`
log-sum-exp."""

NativeArgs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""The native decode's block tables, first keys and key counts, one row per key set."""

KeySets = tuple[NativeArgs, torch.Tensor, torch.Tensor]
"""Key sets for the native decode and which rows read each (`decode_attention`'s
`row_offsets` and `rows`)."""

NativeStep = tuple[torch.Tensor, NativeArgs, torch.Tensor | None, torch.Tensor | None]
"""A step's new tokens' slots and its one native decode's key sets: `KeySets` flattened,
with None and None for one set per row (a decode step)."""


class Seqs(Protocol):
    """Sequences as the reads take them: a `SeqSubset`, or the whole step's metadata."""

    block_tables: torch.Tensor
    kv_lens: torch.Tensor
    q_start: torch.Tensor


class TorchAttentionBackend(AttentionBackend):
    """Decodes, extends and the shared-run passes of tree attention merged in by
    log-sum-exp: on the CPU in fp32 one native call a layer, which merges (`_causal`,
    `_tree`); else batched gathered decodes and per-sequence SDPA. Honours sliding windows,
    but not together with a cascade plan: for a model with a window the worker plans one
    only in steps the window cannot reach."""

    supports_window = True

    def __init__(self, layout: KVLayout | None = None) -> None:
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None
        self._native = None if layout is None else native.decode_attention_fits(
            layout.layers[0][0])
        """Whether the native kernel reads the layout's caches: their dtype, device and
        head_dim are the pool's, so a backend made for a pool asks once. None (the caches
        given by the caller): asked of each call's (`_reads_in_place`)."""

    def begin_forward(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        slots = meta.slot_mapping
        self.store_index = slots // meta.page_size, slots % meta.page_size  # (block, row)
        self.split: CascadeSplit | None = None
        if meta.cascade is not None:
            self.split = CascadeSplit(meta)
        self._plain: tuple[SeqSubset | None, SeqSubset | None] | None = None
        # What each set of reads (whole step, plain parts, own parts) takes is the same for
        # all layers: made on the first layer's call, per window, then reused.
        self._per_step: dict[tuple[str, int | None], NativeArgs] = {}
        self._causal_key_sets: dict[tuple[str, int | None], KeySets] = {}
        self._masks: dict[tuple[str, int | None], tuple[torch.Tensor, torch.Tensor]] = {}
        self._runs: dict[int, tuple[NativeArgs, torch.Tensor]] = {}
        self._tree_key_sets: KeySets | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                window: int | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if rope is not None:
            raise ValueError("the torch backend does not fuse RoPE (fuses_rope is False): "
                             "rotate q and k before forward")
        meta = self.meta
        if window is not None:
            window = active_window(meta, window)
        k_cache.index_put_(self.store_index, k)  # as `paged_torch.store_kv`
        v_cache.index_put_(self.store_index, v)
        if self.split is not None:
            if window is not None:
                raise ValueError("tree attention (a cascade plan) cannot honour a sliding "
                                 "window")
            return self._cascade(q, k_cache, v_cache, scale)
        if meta.max_q_len == 1:
            return self._decode(q, k_cache, v_cache, meta, "step", scale, window)
        if self._reads_in_place(k_cache) and (window is None
                                              or meta.max_q_len <= WINDOW_EXTEND_ROWS):
            return self._causal(q, k_cache, v_cache, meta, "step", scale, window)[0].to(q.dtype)
        return self._mixed(q, k_cache, v_cache, scale, window)

    def native_decode_args(self, k_cache: torch.Tensor) -> NativeStep | None:
        """For a model that runs a step's layers natively (`model/native_layers.py`): the
        new tokens' slots and the native decode's key sets, where `forward` would store at
        the slots and read every layer as one native decode (a cache the kernel reads; the
        model brings no window): the sets `_decode` and `_causal` read, or, with a
        tree-attention plan, `_tree`'s. Else None."""
        meta = self.meta
        if not self._reads_in_place(k_cache):
            return None
        if self.split is None and meta.max_q_len == 1:
            return meta.slot_mapping, self._native_args(meta, "step", None), None, None
        args, row_offsets, rows = (self._tree_args() if self.split is not None
                                   else self._causal_sets(meta, "step", None))
        return meta.slot_mapping, args, row_offsets, rows

    def _reads_in_place(self, k_cache: torch.Tensor) -> bool:
        """Whether the native kernel reads `k_cache` (and its layer's V) where it lies."""
        return native.decode_attention_fits(k_cache) if self._native is None else self._native

    def _mixed(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               scale: float, window: int | None) -> torch.Tensor:
        """A step with long extends (or where the native kernel does not read the cache),
        without a plan: its decodes batched, its extends by SDPA."""
        if self._plain is None:
            lengths = self.meta.host_lengths()
            decodes = [i for i, q in enumerate(lengths.q_lens) if q == 1]
            extends = [i for i, q in enumerate(lengths.q_lens) if q != 1]
            self._plain = (SeqSubset.of(self.meta, lengths, decodes) if decodes else None,
                           SeqSubset.of(self.meta, lengths, extends) if extends else None)
        decode, extend = self._plain
        out = torch.empty_like(q)
        if decode is not None:
            out[decode.tokens] = self._decode(q[decode.tokens], k_cache, v_cache, decode,
                                              "plain", scale, window)
        if extend is not None:
            out[extend.tokens] = paged_torch.extend_attention(
                q[extend.tokens], k_cache, v_cache, extend.block_tables, extend.q_start,
                extend.kv_lens, scale, window=window)
        return out

    def _cascade(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 scale: float) -> torch.Tensor:
        """A step with a plan: the sequences in no run as on the plain path, the grouped
        ones' own parts and each level's shared runs, merged by log-sum-exp (or all of it
        in one native call, `_tree`)."""
        split = self.split
        assert split is not None
        if self._reads_in_place(k_cache):
            return self._tree(q, k_cache, v_cache, scale).to(q.dtype)
        out = torch.empty_like(q)
        if split.decode is not None:
            out[split.decode.tokens] = self._decode(q[split.decode.tokens], k_cache, v_cache,
                                                    split.decode, "plain", scale, None)
        if split.extend is not None:
            e = split.extend
            out[e.tokens] = paged_torch.extend_attention(q[e.tokens], k_cache, v_cache,
                                                         e.block_tables, e.q_start, e.kv_lens,
                                                         scale)
        own = []
        if split.own_decode is not None:
            own.append(self._decode(q[split.own_decode.tokens], k_cache, v_cache,
                                    split.own_decode, "own", scale, None, return_lse=True))
        if split.own_extend is not None:
            e = split.own_extend
            own.append(paged_torch.extend_attention(q[e.tokens], k_cache, v_cache,
                                                    e.block_tables, e.q_start, e.kv_lens,
                                                    scale, return_lse=True))
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
        merged, _ = paged_torch.combine_attention_states(torch.stack(parts_o),
                                                         torch.stack(parts_lse))
        out[split.cascade_rows] = merged.to(q.dtype)
        return out

    # -- reads -----------------------------------------------------------------------------
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

    def _native_args(self, seqs: Seqs, name: str, window: int | None) -> NativeArgs:
        """The native decode's tables, first keys and lengths."""
        key = (name, window)
        if key not in self._per_step:
            lens = seqs.kv_lens.long()
            starts = torch.zeros_like(lens) if window is None else (lens - window).clamp(min=0)
            self._per_step[key] = (seqs.block_tables.contiguous(), starts, lens)
        return self._per_step[key]

    def _gather_blocks(self, seqs: Seqs, name: str,
                       window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks the gathered decode reads and its padding mask (the window's keys
        only) as an additive bias."""
        key = (name, window)
        if key not in self._masks:
            index, valid = paged_torch.decode_blocks(seqs.block_tables, seqs.kv_lens,
                                                     self.meta.page_size)
            if window is not None:
                pos = torch.arange(valid.shape[1], device=valid.device)[None, :]
                valid = valid & (pos >= seqs.kv_lens[:, None] - window)
            self._masks[key] = (index, paged_torch.additive_mask(valid, torch.float32))
        return self._masks[key]

    @overload
    def _decode(self, q, k_cache, v_cache, seqs: Seqs, name: str, scale: float,
                window: int | None, return_lse: Literal[False] = False) -> torch.Tensor: ...
    @overload
    def _decode(self, q, k_cache, v_cache, seqs: Seqs, name: str, scale: float,
                window: int | None, return_lse: bool = False) -> Attended: ...

    def _decode(self, q, k_cache, v_cache, seqs: Seqs, name: str, scale: float,
                window: int | None, return_lse: bool = False) -> Attended:
        """Single-token sequences `seqs` (`name` keys what is made for them once per step),
        `q` their rows."""
        if self._reads_in_place(k_cache):
            out, lse = native.decode_attention(q, k_cache, v_cache,
                                               *self._native_args(seqs, name, window), scale)
            return (out, lse) if return_lse else out.to(q.dtype)
        blocks = self._gather_blocks(seqs, name, window)
        return paged_torch.paged_decode_attention(
            q, k_cache, v_cache, seqs.block_tables, seqs.kv_lens, scale, blocks,
            self._buffers(k_cache, blocks[0].numel()), return_lse=return_lse)

    def _causal_sets(self, seqs: Seqs, name: str, window: int | None) -> KeySets:
        """Each sequence's new rows as key sets for the native decode, causally: rows in
        blocks of `CAUSAL_BLOCK`, a block's keys before its first row one set for all of
        them (read once), and each row's keys from there to its own a set of its own; a
        block of one row (a decode) one set. Under a sliding window every row is its own
        set, from the window's first key."""
        key = (name, window)
        if key not in self._causal_key_sets:
            block = CAUSAL_BLOCK if window is None else 1
            q_start, kv_lens = seqs.q_start.tolist(), seqs.kv_lens.tolist()
            sets: list[tuple[int, int, int, range]] = []  # sequence, first key, end, rows
            for b, kv_len in enumerate(kv_lens):
                first_row, end = q_start[b], q_start[b + 1]
                position = kv_len - end  # of row r: position + r
                for r0 in range(first_row, end, block):
                    r1 = min(end, r0 + block)
                    own = 0  # where the rows' own sets start
                    if r1 - r0 > 1 and position + r0 > 0:
                        own = position + r0
                        sets.append((b, 0, own, range(r0, r1)))
                    for r in range(r0, r1):
                        stop = position + r + 1  # past the row's own key
                        sets.append((b, own if window is None else max(0, stop - window), stop,
                                     range(r, r + 1)))
            seq, starts, lens, members = zip(*sets)
            counts = [len(m) for m in members]
            rows = [r for m in members for r in m]
            offsets = torch.zeros(len(counts) + 1, dtype=torch.long)
            offsets[1:] = torch.tensor(counts).cumsum(0)
            self._causal_key_sets[key] = ((seqs.block_tables[list(seq)].contiguous(),
                                           torch.tensor(starts), torch.tensor(lens)),
                                          offsets, torch.tensor(rows))
        return self._causal_key_sets[key]

    def _causal(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                seqs: Seqs, name: str, scale: float,
                window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequences `seqs` (`q`: their rows), any mix of decodes and extends, read in place
        by one native decode over `_causal_sets`: the fp32 output and log-sum-exp."""
        args, row_offsets, rows = self._causal_sets(seqs, name, window)
        return native.decode_attention(q, k_cache, v_cache, *args, scale, row_offsets, rows)

    # -- tree attention ------------------------------------------------------------------
    def _level_args(self, level: int) -> tuple[NativeArgs, torch.Tensor]:
        """Cascade level `level`'s runs as the native kernel's key sets: one table row per
        run (its blocks, padded), all of its tokens, and its query rows' offsets."""
        if level not in self._runs:
            assert self.split is not None
            t = self.split.levels[level]
            blocks = torch.tensor(t.block_offsets).diff()
            tables = torch.zeros(len(blocks), int(blocks.max()), dtype=torch.int32)
            tables[torch.arange(tables.shape[1])[None, :] < blocks[:, None]] = t.blocks.int()
            lens = blocks * self.meta.page_size
            self._runs[level] = ((tables, torch.zeros_like(lens), lens),
                                 torch.tensor(t.row_offsets))
        return self._runs[level]

    def _tree(self, q, k_cache, v_cache, scale: float) -> torch.Tensor:
        """A step with a cascade plan in one native call: each row reads its whole context
        (a sequence in no run) or its own part, and the runs of its group, each run once
        for all its rows; the kernel merges each row's parts. The fp32 output of every
        row of the step."""
        args, row_offsets, rows = self._tree_args()
        return native.decode_attention(q, k_cache, v_cache, *args, scale, row_offsets,
                                       rows)[0]

    def _tree_args(self) -> KeySets:
        """`_tree`'s key sets (made once per step): the decodes' rows one set each, the
        extends' as `_causal_sets` (plain, then own parts), then each level's runs; each
        set's rows by offsets into `rows`."""
        if self._tree_key_sets is not None:
            return self._tree_key_sets
        split = self.split
        assert split is not None
        parts = []  # (tables, starts, lens), the sets' rows, rows per set
        for subset, name, extend in ((split.decode, "plain", False), (split.extend, "plain", True),
                                     (split.own_decode, "own", False),
                                     (split.own_extend, "own", True)):
            if subset is not None and extend:
                args, row_offsets, rows = self._causal_sets(subset, name, None)
                parts.append((args, subset.tokens[rows], row_offsets.diff()))
            elif subset is not None:
                parts.append((self._native_args(subset, name, None), subset.tokens,
                              torch.ones(len(subset.tokens), dtype=torch.long)))
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
        self._tree_key_sets = (tables, starts, lens), offsets, torch.cat([r for _, r, _ in parts])
        return self._tree_key_sets

    def _shared_runs(self, q, k_cache, v_cache, level: int,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Cascade level `level`'s shared-run pass: fp32 output and log-sum-exp of its
        rows (`CascadeLevelTensors.rows`), each run read once for all its rows."""
        assert self.split is not None
        t = self.split.levels[level]
        if self._reads_in_place(k_cache):
            args, row_offsets = self._level_args(level)
            return native.decode_attention(q[t.rows], k_cache, v_cache, *args, scale,
                                           row_offsets)
        return paged_torch.cascade_level_attention(q, k_cache, v_cache, t.rows, t.row_offsets,
                                                   t.blocks, t.block_offsets, scale)

