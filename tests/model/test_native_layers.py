"""The fp32 CPU kernels an unquantized decoder layer runs through once `DecoderModel.pack`
has run (`radixserve/native`): the dense projection (its own GEMV up to 128 rows, sgemm
above), the residual add fused with RMSNorm, and the in-place rotary embedding, each
against the torch ops they replace. Greedy equality with transformers through them is
the engine suites' business (`test_engine_exact.py` runs this path)."""

from __future__ import annotations

import pytest
import torch

import radixserve.native as native
from radixserve.model.linear import F32Weight, Linear
from radixserve.model.llama import RMSNorm
from radixserve.model.rotary import apply_rotary

pytestmark = pytest.mark.skipif(not native.available(), reason="the CPU kernels do not build here")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 48, 128, 129, 200])
@pytest.mark.parametrize("n,k", [(960, 576), (7, 33), (49152 // 64, 1536)])
def test_f32_weight_equals_linear(rows, n, k) -> None:
    gen = torch.Generator().manual_seed(rows * n + k)
    w, x, b = (torch.randn(*s, generator=gen) for s in ((n, k), (rows, k), (n,)))
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    got = F32Weight(w).matmul(x, b)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    tolerance = 1e-4 * float(want.abs().max())
    assert torch.allclose(F32Weight(w).matmul(x, None), got - b, atol=tolerance)


def test_packed_linear_keeps_one_copy_and_any_leading_shape() -> None:
    layer = Linear(64, (32, 16), bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(2, 3, 64)
    want = layer(x)
    layer.pack()
    assert layer.weight.numel() == 0 and layer.weight_bytes == 48 * 64 * 4
    assert torch.allclose(layer(x), want, atol=1e-5)


@pytest.mark.parametrize("rows,size", [(1, 576), (7, 576), (300, 100), (2, 17)])
def test_add_rms_norm_adds_in_place_and_normalises(rows, size) -> None:
    gen = torch.Generator().manual_seed(rows + size)
    x, delta = torch.randn(rows, size, generator=gen), torch.randn(rows, size, generator=gen)
    norm = RMSNorm(size, 1e-5)
    norm.weight.data = torch.randn(size, generator=gen)
    plain_x = x.clone()
    want = norm(plain_x, delta)  # the torch ops: add in place, then rms_norm
    norm.use_native = True
    got = norm(x, delta)
    assert torch.equal(x, plain_x)  # the residual stream holds the same sum
    assert (got - want).abs().max() <= 4e-7 * want.abs().max()
    assert torch.allclose(norm(x.clone()), torch.nn.functional.rms_norm(
        x, (size,), norm.weight, 1e-5), atol=1e-6)


def test_norm_of_strided_rows_takes_torchs_path() -> None:
    """Qwen3's q/k norms run on heads inside the fused QKV output: not contiguous rows."""
    qkv = torch.randn(3, 4, 32)
    norm = RMSNorm(16, 1e-6)
    norm.use_native = True
    heads = qkv[:, :2, :16]
    assert torch.equal(norm(heads), torch.nn.functional.rms_norm(heads, (16,), norm.weight, 1e-6))


@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_rotary_in_place_is_bit_for_bit_torchs(tokens) -> None:
    """On q and k where they sit in the fused QKV output (a strided view)."""
    heads, kv_heads, dim = 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    qk = qkv[:, :(heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
    positions = torch.randint(0, 4096, (tokens,))
    freqs = torch.outer(positions.float(), 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    v_before = qkv[:, (heads + kv_heads) * dim:].clone()
    want = apply_rotary(qk, cos, sin)
    assert apply_rotary(qk, cos, sin, in_place=True) is qk
    assert torch.equal(qk, want)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v_before)
