"""A GGUF's Q8_0 tensor (the default model's tied embedding and LM head) for torch's int4
CPU kernel, exactly, as two 4-bit halves.

Q8_0 holds value = d * q per 32 inputs, q an int8. Split q = 16 * hi + lo (hi = q >> 4 in
-8..7, lo = q & 15 in 0..15): with torch's (code - 8) * scale + zero, the high half is codes
hi + 8, scale 16d, zero 0, and the low half codes lo, scale d, zero 8d; their sum is
d * q. Rounding d to bf16 (the kernel's scale dtype) rounds 16d and 8d alike (powers of
two), so the sum is bf16(d) * q: the file's codes with the same scale rounding as the
4-bit projections. Two 4-bit reads (1.25 bytes a weight with scales) instead of fp32's 4.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from radixserve.model.quant.gguf_q4 import fp16_field
from radixserve.model.quant.int4 import Int4Groups, Int4Weight


def q8_0_halves(data: np.ndarray) -> tuple[Int4Groups, Int4Groups]:
    """`data`: a Q8_0 tensor's raw blocks, `[rows, bytes per row]` (gguf's reader)."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, 34)  # an fp16 d, then 32 int8 codes
    d = torch.from_numpy(fp16_field(blocks, 0))
    q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).astype(np.int16)).reshape(rows, -1)
    high = Int4Groups(((q >> 4) + 8).to(torch.uint8), 16 * d, torch.zeros_like(d))
    low = Int4Groups((q & 15).to(torch.uint8), d, 8 * d)
    return high, low


class SplitInt8Weight:
    """Two 4-bit weights whose products add up to the 8-bit one's."""

    def __init__(self, halves: tuple[Int4Groups, Int4Groups],
                 compute_dtype: torch.dtype | None = None) -> None:
        extra = {} if compute_dtype is None else {"compute_dtype": compute_dtype}
        self.high, self.low = (Int4Weight(h, **extra) for h in halves)

    @property
    def nbytes(self) -> int:
        return self.high.nbytes + self.low.nbytes

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.high.matmul(x, None) + self.low.matmul(x, bias)


def read_q8_head(gguf_path: Path) -> tuple[Int4Groups, Int4Groups] | None:
    """The file's LM head (`output.weight`, else the tied `token_embd.weight`, as the
    converter decides) split in halves where it is Q8_0; None for any other type."""
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
    head = tensors.get("output.weight") or tensors["token_embd.weight"]
    if head.tensor_type != gguf.GGMLQuantizationType.Q8_0:
        return None
    return q8_0_halves(np.asarray(head.data))
