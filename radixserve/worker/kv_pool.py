"""The KV pool: the K and V tensors of every layer, cut into fixed-size blocks; its
layout (paged here, virtual in `virtual_kv.py` and `virtual_kv_cuda.py`) is the pool's.

In the paged layout a step's block ids are the pool's own: the attention reads the step's
tables as the worker keeps them (`StepSeqs.block_tables`, `slot_mapping`), and a step asks
nothing of the pool. The virtual layouts map views of the blocks for each step: they give
its tables in their views (`VirtualKVPool.step_tables`) and map ahead once it is queued
(`map_ahead`). Every layout answers `release_all` (after a flush) and `mappings` (for the
stats). What an attention backend asks: `attention.base.KVLayout` (`layers`,
`contiguous`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.worker.cascade import CascadePlan
from radixserve.worker.staging import to_device


@dataclass
class StepTables:
    """A step's KV addresses in the views a virtual layout maps for it
    (`AttentionMetadata` takes them)."""

    block_tables: torch.Tensor
    """`[B, max_blocks]` int32 on the host: each sequence's blocks, padded (the worker
    stages them to the device)."""
    slot_mapping: torch.Tensor
    """`[T]` int64: where each new token's KV goes, flat."""
    cascade: CascadePlan | None
    """The step's tree-attention plan with its blocks named as in `block_tables`."""


class KVPool:
    """One tensor `[layers, 2, num_blocks, page_size, num_kv_heads, head_dim]`.

    The worker owns the memory; which block holds which tokens is the scheduler's business.
    Zero-filled so that padded reads past a sequence's end never meet NaNs. The paged
    layout: a step's block ids are the pool's own.
    """

    contiguous = False

    def __init__(self, num_layers: int, num_blocks: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_blocks, self.page_size = num_blocks, page_size
        self.buffer = torch.zeros(num_layers, 2, num_blocks, page_size, num_kv_heads, head_dim,
                                  dtype=dtype, device=device)
        self.layers = [(self.buffer[i, 0], self.buffer[i, 1]) for i in range(num_layers)]

    def mappings(self) -> tuple[int, int]:
        """The kernel memory mappings (VMAs) the layout's views hold, and the budget they
        keep to: (0, 0) for a layout that maps none."""
        return 0, 0

    def release_all(self) -> None:
        """Drop every view of the blocks a layout keeps (after a cache flush): the paged
        layout keeps none."""

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: block `src`'s K and V in every layer into block `dst`, for each pair
        (one gather and one scatter over the whole pool, however many pairs)."""
        if copies:
            src, dst = to_device(list(zip(*copies)), self.buffer.device)
            self.buffer[:, :, dst] = self.buffer[:, :, src]

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """A CPU copy of these blocks' K and V in every layer, `[layers, 2, len(blocks), ...]`
        (the disk tier saves it; the blocks may be reused right after)."""
        return self.buffer[:, :, to_device(blocks, self.buffer.device)].cpu()

    def write_blocks(self, blocks: list[int], kv: torch.Tensor) -> None:
        """Put `kv` (as `read_blocks` gives it) into these blocks."""
        self.buffer[:, :, to_device(blocks, self.buffer.device)] = kv.to(self.buffer.device)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @staticmethod
    def bytes_per_block(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * dtype.itemsize
