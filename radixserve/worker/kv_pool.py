"""The KV pool: the K and V tensors of every layer, cut into fixed-size blocks."""

from __future__ import annotations

import torch


class KVPool:
    """One tensor `[layers, 2, num_blocks, page_size, num_kv_heads, head_dim]`.

    The worker owns the memory; which block holds which tokens is the scheduler's business.
    Zero-filled so that padded reads past a sequence's end never meet NaNs.
    """

    def __init__(self, num_layers: int, num_blocks: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_blocks, self.page_size = num_blocks, page_size
        self.buffer = torch.zeros(num_layers, 2, num_blocks, page_size, num_kv_heads, head_dim,
                                  dtype=dtype, device=device)
        self.layers = [(self.buffer[i, 0], self.buffer[i, 1]) for i in range(num_layers)]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: block `src`'s K and V in every layer into block `dst`, for each pair
        (one gather and one scatter over the whole pool, however many pairs)."""
        if copies:
            src, dst = (torch.tensor(c, dtype=torch.long, device=self.buffer.device)
                        for c in zip(*copies))
            self.buffer[:, :, dst] = self.buffer[:, :, src]

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """A CPU copy of these blocks' K and V in every layer, `[layers, 2, len(blocks), ...]`
        (the disk tier saves it; the blocks may be reused right after)."""
        index = torch.tensor(blocks, dtype=torch.long, device=self.buffer.device)
        return self.buffer[:, :, index].cpu()

    def write_blocks(self, blocks: list[int], kv: torch.Tensor) -> None:
        """Put `kv` (as `read_blocks` gives it) into these blocks."""
        index = torch.tensor(blocks, dtype=torch.long, device=self.buffer.device)
        self.buffer[:, :, index] = kv.to(self.buffer.device)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @staticmethod
    def bytes_per_block(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * dtype.itemsize
