"""4-bit `Groups` (codes 0..15) packed for the fp32 CPU kernel
(`radixserve/native/quant_matmul.cpp`: `q4_matmul`)."""

from __future__ import annotations

import torch

import radixserve.native as native
from radixserve.model.quant.groups import GROUP, Groups, check_shape


class Int4Weight:
    """A row's codes two to a byte, each group's 16 bytes holding its codes j (low nibble)
    and j + 16 (high), so that one 16-byte load widens to the group's two halves; rows in
    memory order, then scales, then lows."""

    def __init__(self, groups: Groups) -> None:
        n, k = groups.codes.shape
        check_shape(n, k)
        codes = groups.codes.reshape(n, k // GROUP, GROUP)
        self.codes = (codes[..., :GROUP // 2] | (codes[..., GROUP // 2:] << 4)) \
            .reshape(n, k // 2).contiguous()
        self.scale = groups.scale.float().contiguous()
        self.low = groups.low.float().contiguous()

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + self.low.nbytes

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return native.matmul("q4_matmul", x, bias, self.codes, self.scale, self.low)
