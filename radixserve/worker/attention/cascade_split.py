"""Tree attention's split of a step, shared by the backends.

A step whose metadata carries a cascade plan (`worker/cascade.py`) does tree attention:
`CascadeSplit` says, once per step and for every backend, which sequences attend alone,
which attend their own part past their shared runs, and which runs each level reads once
per group (then merged by log-sum-exp). A step without a plan builds none: every sequence
attends alone, as the metadata gives them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.worker.attention.base import AttentionMetadata
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

    @classmethod
    def of(cls, meta: AttentionMetadata, seqs: torch.Tensor,
           start: torch.Tensor | None = None) -> SeqSubset:
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


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


class CascadeSplit:
    """What a step's cascade plan means for the attention calls, shared by the backends:
    the sequences attended alone (decodes, extends), those in shared runs (their own parts,
    decodes and extends), and each level's runs, all as tensors built once per step."""

    def __init__(self, meta: AttentionMetadata) -> None:
        """`meta`: a step with a plan."""
        dev = meta.q_lens.device
        plan = meta.cascade
        assert plan is not None
        own = to_device(plan.own_start, dev)
        single = meta.q_lens == 1

        def subset(seqs: torch.Tensor, start: bool) -> SeqSubset | None:
            if not len(seqs):
                return None
            return SeqSubset.of(meta, seqs, own[seqs] if start else None)

        lone = own == 0
        self.decode = subset(torch.nonzero(single & lone).flatten(), False)
        self.extend = subset(torch.nonzero(~single & lone).flatten(), False)
        self.levels: list[CascadeLevelTensors] = []
        # Grouped sequences in the order of the first level's runs (every grouped sequence
        # is in one): in an all-decode step that level's rows are then the accumulators'.
        order = to_device([s for run in plan.levels[0] for s in run.seqs], dev)
        self.own_decode = subset(order[single[order]], True)
        self.own_extend = subset(order[~single[order]], True)
        own_rows = [s.tokens for s in (self.own_decode, self.own_extend) if s is not None]
        self.cascade_rows = torch.cat(own_rows)
        position = torch.full((int(meta.q_start[-1]),), -1, dtype=torch.long, device=dev)
        position[self.cascade_rows] = torch.arange(len(self.cascade_rows), device=dev)
        cascade_rows = self.cascade_rows.tolist()
        starts = meta.q_start.tolist()
        for level in plan.levels:
            rows: list[int] = []
            row_offsets, blocks, block_offsets = [0], [], [0]
            for run in level:
                for seq in run.seqs:
                    rows.extend(range(starts[seq], starts[seq + 1]))
                row_offsets.append(len(rows))
                blocks.extend(run.blocks)
                block_offsets.append(len(blocks))
            rows_t = to_device(rows, dev)
            self.levels.append(CascadeLevelTensors(
                rows_t, row_offsets, to_device(blocks, dev),
                block_offsets, position[rows_t], rows == cascade_rows))
