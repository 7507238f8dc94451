"""Rotary position embeddings: the inverse frequencies of each supported RoPE scaling
(linear, llama3, yarn), the cos/sin table by position, and the rotation itself."""

from __future__ import annotations

import math
from typing import Any, overload

import torch
from torch import nn

import radixserve.native as native

from radixserve.model.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":
        return _yarn(config, scaling, inv_freq)[0]
    raise ValueError(f"unsupported rope_scaling type {kind!r}")  # config.py refuses it first


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor on cos and sin (YaRN's attention temperature; 1 otherwise)."""
    scaling = config.rope_scaling
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    return _yarn(config, scaling, None)[1]


@overload
def _yarn(config: ModelConfig, scaling: dict[str, Any],
          inv_freq: torch.Tensor) -> tuple[torch.Tensor, float]: ...
@overload
def _yarn(config: ModelConfig, scaling: dict[str, Any], inv_freq: None) -> tuple[None, float]: ...


def _yarn(config: ModelConfig, scaling: dict[str, Any],
          inv_freq: torch.Tensor | None) -> tuple[torch.Tensor | None, float]:
    """YaRN (NTK-by-parts interpolation and an attention temperature), as transformers'
    `_compute_yarn_parameters` computes it; `scaling`: `config.rope_scaling`."""
    dim, base = config.head_dim, config.rope_theta
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all \
            else mscale(factor)
    if inv_freq is None:
        return None, attention_factor
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    interpolation = inv_freq / factor
    return interpolation * (1 - extrapolation) + inv_freq * extrapolation, attention_factor


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, looked up once per step for all layers."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inv_freq(config))
        emb = torch.cat([freqs, freqs], dim=-1)
        factor = rope_attention_factor(config)
        cos, sin = emb.cos(), emb.sin()
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`[T, 1, head_dim]` cos and sin of each token's position."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 in_place: bool = False) -> torch.Tensor:
    """Rotate `x` (`[T, heads, head_dim]`, any strides with head_dim contiguous), as
    transformers does. `in_place` (fp32 on a CPU with the native kernels): into `x`
    itself, bit for bit the same values."""
    if in_place:
        native.rotary_(x, cos, sin)
        return x
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin
