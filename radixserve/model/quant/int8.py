"""8-bit weights, one scale per output channel, for torch's int8 weight-only CPU matmul."""

from __future__ import annotations

import torch

from radixserve.model.quant.int4 import COMPUTE_DTYPE


class Int8Weight:
    """`[N, K]` int8 codes and `[N]` scales: value = code * scale, symmetric (the row's
    largest magnitude maps to 127). Activations and scales run in `compute_dtype` (bf16 by
    default: the kernel's fp32 path is 4-20x slower here, see `int4.COMPUTE_DTYPE`)."""

    def __init__(self, weight: torch.Tensor, compute_dtype: torch.dtype = COMPUTE_DTYPE) -> None:
        w = weight.detach().float()
        scale = w.abs().amax(1) / 127
        self.codes = (w / torch.where(scale == 0, 1, scale)[:, None]).round() \
            .clamp(-127, 127).to(torch.int8)
        self.compute_dtype = compute_dtype
        self.scale = scale.to(compute_dtype)

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scale.float()[:, None]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = torch.ops.aten._weight_int8pack_mm(
            x.to(self.compute_dtype), self.codes, self.scale).to(x.dtype)
        return out if bias is None else out + bias
