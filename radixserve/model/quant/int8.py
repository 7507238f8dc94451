"""8-bit weights with fp32 scales per group of inputs, for the fp32 CPU kernel
(`radixserve/native/quant_matmul.cpp`): `int8` per output channel (a group is the whole row), and a GGUF's
Q8_0 head (`gguf_q8.py`: groups of 32)."""

from __future__ import annotations

import torch

import radixserve.native as native


class Int8Weight:
    """`[N, K]` int8 codes and `[N, K / group]` fp32 scales: value = code * scale."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor) -> None:
        self.codes = codes.to(torch.int8).contiguous()
        self.scale = scale.float().reshape(codes.shape[0], -1).contiguous()

    @staticmethod
    def quantize(weight: torch.Tensor) -> Int8Weight:
        """Symmetric, per output channel: the row's largest magnitude maps to 127."""
        w = weight.detach().float()
        scale = w.abs().amax(1) / 127
        codes = (w / torch.where(scale == 0, 1, scale)[:, None]).round().clamp(-127, 127)
        return Int8Weight(codes, scale)

    def dequantize(self) -> torch.Tensor:
        group = self.codes.shape[1] // self.scale.shape[1]
        return self.codes.float() * self.scale.repeat_interleave(group, 1)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return native.matmul("int8_matmul", x, bias, self.codes, self.scale)
