"""4-bit group-wise weights for torch's int4 CPU matmul.

A weight `[N, K]` is held as codes 0..15 with one scale and one zero per group of `GROUP`
consecutive inputs of a row (groups run along the input dimension, so output rows, and
with them fused projections' parts and tensor-parallel column shards, concatenate freely).
torch's convention, checked against its kernel: value = (code - 8) * scale + zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32
"""Inputs per scale: GGUF's Q4_0/Q4_1 block and Q4_K's sub-block, and torch's smallest."""

COMPUTE_DTYPE = torch.bfloat16
"""Activations (and so scales, which the kernel wants in the activations' dtype) are cast
to this for the matmul: torch's int4 kernel is 13-60x slower with fp32 or fp16 activations
than with bf16 here (`bench/quant.py`), slower than the dense fp32 matmul it replaces."""


@dataclass(frozen=True)
class Int4Groups:
    """Codes `[N, K]` (uint8, 0..15) and per-group `scale`, `zero` `[N, K / GROUP]` (fp32):
    the unpacked form, where rows are permuted, sliced and concatenated."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        """fp32 `[N, K]` values, as the kernel computes them with fp32 activations."""
        return (self.codes.float() - 8) * self.scale.repeat_interleave(GROUP, 1) + \
            self.zero.repeat_interleave(GROUP, 1)

    def rows(self, index: torch.Tensor | slice) -> Int4Groups:
        return Int4Groups(self.codes[index], self.scale[index], self.zero[index])

    def narrow(self, dim: int, start: int, length: int) -> Int4Groups:
        """Rows (`dim` 0) or inputs (`dim` 1, whole groups only) `start:start + length`."""
        if dim == 0:
            return self.rows(slice(start, start + length))
        if start % GROUP or length % GROUP:
            raise ValueError(f"a 4-bit weight splits along its inputs in whole groups of "
                             f"{GROUP}, not at {start}:{start + length}")
        g0, g = start // GROUP, length // GROUP
        return Int4Groups(self.codes[:, start:start + length], self.scale[:, g0:g0 + g],
                          self.zero[:, g0:g0 + g])

    @staticmethod
    def cat(parts: list[Int4Groups]) -> Int4Groups:
        """Parts stacked along the output dimension (a fused projection)."""
        return Int4Groups(*(torch.cat([getattr(p, f) for p in parts])
                            for f in ("codes", "scale", "zero")))

    @staticmethod
    def quantize(weight: torch.Tensor) -> Int4Groups:
        """Asymmetric min/max quantization of each group (as GGUF's Q4_1 writes it): the
        group's minimum maps to code 0 and its maximum to 15."""
        n, k = weight.shape
        check_shape(n, k)
        w = weight.detach().float().reshape(n, k // GROUP, GROUP)
        low, high = w.amin(-1), w.amax(-1)
        scale = (high - low) / 15
        inverse = torch.where(scale == 0, 0, 1 / scale)
        codes = ((w - low[..., None]) * inverse[..., None]).round().clamp(0, 15)
        return Int4Groups(codes.to(torch.uint8).reshape(n, k), scale, low + 8 * scale)


def check_shape(n: int, k: int) -> None:
    """torch's int4 CPU kernel packs N in tiles of 16 and K in groups."""
    if n % 16 or k % GROUP:
        raise ValueError(f"4-bit weights need the output size divisible by 16 and the input "
                         f"size by {GROUP}: this projection is {n} x {k}")


class Int4Weight:
    """Packed codes and `[K / GROUP, N, 2]` scales and zeros in the compute dtype."""

    def __init__(self, groups: Int4Groups, compute_dtype: torch.dtype = COMPUTE_DTYPE) -> None:
        n, k = groups.codes.shape
        check_shape(n, k)
        self.compute_dtype = compute_dtype
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            groups.codes.to(torch.int32), 1)
        self.scale_zero = torch.stack([groups.scale.t(), groups.zero.t()], dim=-1) \
            .to(compute_dtype).contiguous()

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale_zero.nbytes

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(self.compute_dtype), self.packed, GROUP, self.scale_zero).to(x.dtype)
        return out if bias is None else out + bias
