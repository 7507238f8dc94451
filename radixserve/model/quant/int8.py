"""8-bit `Groups` (codes 0..255) for the fp32 CPU kernel (`radixserve/native/
quant_matmul.cpp`: `int8_matmul`): `int8`'s projections, quantized from floats with a
scale and low per 32 inputs (a weight moves by at most 1/510 of its group's range), and a
GGUF's Q8_0 head (`gguf_q8.py`)."""

from __future__ import annotations

import torch

import radixserve.native as native
from radixserve.model.quant.groups import Groups, check_shape


class Int8Weight:
    """The groups' own arrays, contiguous: a row's codes one a byte in input order, then
    scales, then lows."""

    def __init__(self, groups: Groups) -> None:
        check_shape(*groups.shape)
        self.groups = Groups(groups.codes.to(torch.uint8).contiguous(),
                             groups.scale.float().contiguous(), groups.low.float().contiguous())

    def dequantize(self) -> torch.Tensor:
        return self.groups.dequantize()

    @property
    def nbytes(self) -> int:
        g = self.groups
        return g.codes.nbytes + g.scale.nbytes + g.low.nbytes

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        g = self.groups
        return native.matmul("int8_matmul", x, bias, g.codes, g.scale, g.low)
