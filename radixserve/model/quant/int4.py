"""4-bit group-wise weights for the fp32 CPU kernel (`radixserve/native/quant_matmul.cpp`).

A weight `[N, K]` is held as codes 0..15 with one scale and one `low` per group of `GROUP`
consecutive inputs of a row (groups run along the input dimension, so output rows, and
with them fused projections' parts and tensor-parallel column shards, concatenate freely):
value = code * scale + low. A GGUF's Q4_0, Q4_1 and Q4_K blocks all have this form with
their own numbers (`gguf_q4.py`), so the file's values are held, and computed, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import radixserve.native as native

GROUP = 32
"""Inputs per scale: GGUF's Q4_0/Q4_1 block and Q4_K's sub-block."""


@dataclass(frozen=True)
class Int4Groups:
    """Codes `[N, K]` (uint8, 0..15) and per-group `scale`, `low` `[N, K / GROUP]` (fp32):
    the unpacked form, where rows are permuted, sliced and concatenated."""

    codes: torch.Tensor
    scale: torch.Tensor
    low: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        """fp32 `[N, K]` values. The kernel rounds code * scale + low once (a fused
        multiply-add), this twice: they are equal wherever the product is exact in fp32, as
        it is for every GGUF block (an fp16 scale, or Q4_K's fp16 times a 6-bit integer,
        times a 4-bit code)."""
        return self.codes.float() * self.scale.repeat_interleave(GROUP, 1) + \
            self.low.repeat_interleave(GROUP, 1)

    def rows(self, index: torch.Tensor | slice) -> Int4Groups:
        return Int4Groups(self.codes[index], self.scale[index], self.low[index])

    def narrow(self, dim: int, start: int, length: int) -> Int4Groups:
        """Rows (`dim` 0) or inputs (`dim` 1, whole groups only) `start:start + length`."""
        if dim == 0:
            return self.rows(slice(start, start + length))
        if start % GROUP or length % GROUP:
            raise ValueError(f"a 4-bit weight splits along its inputs in whole groups of "
                             f"{GROUP}, not at {start}:{start + length}")
        g0, g = start // GROUP, length // GROUP
        return Int4Groups(self.codes[:, start:start + length], self.scale[:, g0:g0 + g],
                          self.low[:, g0:g0 + g])

    @staticmethod
    def cat(parts: list[Int4Groups]) -> Int4Groups:
        """Parts stacked along the output dimension (a fused projection)."""
        return Int4Groups(*(torch.cat([getattr(p, f) for p in parts])
                            for f in ("codes", "scale", "low")))

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
        return Int4Groups(codes.to(torch.uint8).reshape(n, k), scale, low)


def check_shape(n: int, k: int) -> None:
    """The kernel takes whole groups of inputs (any number of outputs)."""
    if k % GROUP:
        raise ValueError(f"4-bit weights need the input size divisible by {GROUP}: this "
                         f"projection is {n} x {k}")


class Int4Weight:
    """`Int4Groups` packed for the kernel: a row's codes two to a byte, each group's 16
    bytes holding its codes j (low nibble) and j + 16 (high), so that one 16-byte load
    widens to the group's two halves; rows in memory order, then scales, then lows."""

    def __init__(self, groups: Int4Groups) -> None:
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
        return native.matmul("q4_matmul", x, bias, self.codes, self.scale,
                               self.low)
