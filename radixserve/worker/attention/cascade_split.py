"""Tree attention's split of a step, shared by the backends.

A step whose metadata carries a cascade plan (`worker/cascade.py`) does tree attention:
`CascadeSplit` says, once per step and for every backend, which sequences attend alone,
which attend their own part past their shared runs, and which runs each level reads once
per group (then merged by log-sum-exp). A step without a plan builds none: every sequence
attends alone, as the metadata gives them.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from radixserve.worker.attention.base import AttentionMetadata, StepLengths
from radixserve.worker.staging import to_device


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
    max_q_len: int
    max_kv_len: int
    """The longest of the subset's new tokens and (past `start`) contexts, known on the
    host."""

    @classmethod
    def of(cls, meta: AttentionMetadata, lengths: StepLengths, seqs: list[int],
           start: list[int] | None = None) -> SeqSubset:
        """`seqs` of `meta`, from token `start[i]` (page-aligned) of each, or from 0: built
        from the host's lengths, so nothing is read back from the device."""
        dev = meta.q_lens.device
        q_lens = [lengths.q_lens[s] for s in seqs]
        kv_lens = [lengths.kv_lens[s] for s in seqs]
        seqs_t = to_device(seqs, dev)
        tables, kv_lens_t = meta.block_tables[seqs_t], meta.kv_lens[seqs_t]
        if start is not None:
            skip = to_device([x // meta.page_size for x in start], dev)
            cols = torch.arange(tables.shape[1], device=dev)[None, :] + skip[:, None]
            tables = tables.gather(1, cols.clamp(max=tables.shape[1] - 1))
            kv_lens_t = kv_lens_t - to_device(start, dev, kv_lens_t.dtype)
            kv_lens = [kv - x for kv, x in zip(kv_lens, start)]
        return cls(seqs_t, to_device(lengths.rows(seqs), dev), tables, kv_lens_t,
                   to_device([0, *accumulate(q_lens)], dev, torch.int32), max(q_lens),
                   max(kv_lens))


@dataclass
class CascadeLevelTensors:
    """One cascade level as tensors, in the layout `paged_torch.cascade_level_attention` takes."""

    rows: torch.Tensor
    """`[R]` int64 token rows of the level's runs, run by run."""
    row_offsets: list[int]
    blocks: torch.Tensor
    block_offsets: list[int]
    acc_index: torch.Tensor
    """`[R]`: where each row sits among the cascaded rows (the merge accumulators)."""
    in_order: bool
    """The level's rows are all the cascaded rows, in their order (`acc_index` is 0..R-1)."""


class CascadeSplit:
    """What a step's cascade plan means for the attention calls, shared by the backends:
    the sequences attended alone (decodes, extends), those in shared runs (their own parts,
    decodes and extends), and each level's runs, all as tensors built once per step from
    the host's lengths (`AttentionMetadata.lengths`) and the plan (one copy to the device
    each, nothing read back)."""

    def __init__(self, meta: AttentionMetadata) -> None:
        """`meta`: a step with a plan."""
        dev = meta.q_lens.device
        plan = meta.cascade
        assert plan is not None
        lengths = meta.host_lengths()
        single, own = [q == 1 for q in lengths.q_lens], plan.own_start

        def subset(seqs: list[int], start: bool) -> SeqSubset | None:
            if not seqs:
                return None
            return SeqSubset.of(meta, lengths, seqs, [own[s] for s in seqs] if start else None)

        lone = [s for s, start in enumerate(own) if start == 0]
        self.decode = subset([s for s in lone if single[s]], False)
        self.extend = subset([s for s in lone if not single[s]], False)
        # Grouped sequences in the order of the first level's runs (every grouped sequence
        # is in one): in an all-decode step that level's rows are then the accumulators'.
        order = [s for run in plan.levels[0] for s in run.seqs]
        own_decode = [s for s in order if single[s]]
        own_extend = [s for s in order if not single[s]]
        self.own_decode, self.own_extend = subset(own_decode, True), subset(own_extend, True)
        cascade_rows = lengths.rows(own_decode + own_extend)
        self.cascade_rows = to_device(cascade_rows, dev)
        position = {row: i for i, row in enumerate(cascade_rows)}
        self.levels: list[CascadeLevelTensors] = []
        for level in plan.levels:
            rows: list[int] = []
            row_offsets, blocks, block_offsets = [0], [], [0]
            for run in level:
                rows += lengths.rows(run.seqs)
                row_offsets.append(len(rows))
                blocks.extend(run.blocks)
                block_offsets.append(len(blocks))
            self.levels.append(CascadeLevelTensors(
                to_device(rows, dev), row_offsets, to_device(blocks, dev), block_offsets,
                to_device([position[r] for r in rows], dev), rows == cascade_rows))
