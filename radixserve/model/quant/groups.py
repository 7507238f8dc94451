"""Group-wise weights, the one quantized form of a projection (`q4` and `int8` alike).

A weight `[N, K]` is held as unsigned codes with one scale and one `low` per group of
`GROUP` consecutive inputs of a row (groups run along the input dimension, so output rows,
and with them fused projections' parts and tensor-parallel column shards, concatenate
freely): value = code * scale + low. The formats differ only in the codes' width and how
the kernel packs them (`int4.py`: 0..15, two a byte; `int8.py`: 0..255). A GGUF's Q4_0,
Q4_1 and Q4_K blocks (`gguf_q4.py`) and Q8_0 blocks (`gguf_q8.py`) all have this form
with their own numbers, so a file's values are held, and computed, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32
"""Inputs per scale: GGUF's Q4_0/Q4_1/Q8_0 block and Q4_K's sub-block."""


@dataclass(frozen=True)
class Groups:
    """Codes `[N, K]` (uint8) and per-group `scale`, `low` `[N, K / GROUP]` (fp32): the
    unpacked form, where rows are permuted, sliced and concatenated."""

    codes: torch.Tensor
    scale: torch.Tensor
    low: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        """fp32 `[N, K]` values. The kernel rounds code * scale + low once (a fused
        multiply-add), this twice: they are equal wherever the product is exact in fp32, as
        it is for every GGUF block (an fp16 scale times a code of at most 8 bits, or Q4_K's
        fp16 times a 6-bit integer times a 4-bit code)."""
        return self.codes.float() * self.scale.repeat_interleave(GROUP, 1) + \
            self.low.repeat_interleave(GROUP, 1)

    def rows(self, index: torch.Tensor | slice) -> Groups:
        return Groups(self.codes[index], self.scale[index], self.low[index])

    def narrow(self, dim: int, start: int, length: int) -> Groups:
        """Rows (`dim` 0) or inputs (`dim` 1, whole groups only) `start:start + length`."""
        if dim == 0:
            return self.rows(slice(start, start + length))
        if start % GROUP or length % GROUP:
            raise ValueError(f"a quantized weight splits along its inputs in whole groups "
                             f"of {GROUP}, not at {start}:{start + length}")
        g0, g = start // GROUP, length // GROUP
        return Groups(self.codes[:, start:start + length], self.scale[:, g0:g0 + g],
                      self.low[:, g0:g0 + g])

    @staticmethod
    def cat(parts: list[Groups]) -> Groups:
        """Parts stacked along the output dimension (a fused projection)."""
        return Groups(*(torch.cat([getattr(p, f) for p in parts])
                        for f in ("codes", "scale", "low")))

    @staticmethod
    def quantize(weight: torch.Tensor, bits: int) -> Groups:
        """Asymmetric min/max quantization of each group (as GGUF's Q4_1 writes it): the
        group's minimum maps to code 0 and its maximum to 2**bits - 1, so a weight moves
        by at most half a step, (max - min) / (2 * (2**bits - 1))."""
        n, k = weight.shape
        check_shape(n, k)
        top = 2 ** bits - 1
        w = weight.detach().float().reshape(n, k // GROUP, GROUP)
        low, high = w.amin(-1), w.amax(-1)
        scale = (high - low) / top
        inverse = torch.where(scale == 0, 0, 1 / scale)
        codes = ((w - low[..., None]) * inverse[..., None]).round().clamp(0, top)
        return Groups(codes.to(torch.uint8).reshape(n, k), scale, low)


def check_shape(n: int, k: int) -> None:
    """The kernels take whole groups of inputs (any number of outputs)."""
    if k % GROUP:
        raise ValueError(f"quantized weights need the input size divisible by {GROUP}: this "
                         f"projection is {n} x {k}")
