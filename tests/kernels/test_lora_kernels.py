"""The multi-LoRA kernels (kernels/lora.py) against a per-token torch reference in fp64.

Runs on the CPU under `TRITON_INTERPRET=1`, as tests/kernels/test_kernels.py does, with
its conventions: tiny shapes (non-powers of two among them, so every tile's mask is
used), and NaN poison in the slots no token uses, which must leak nowhere.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from radixserve.kernels.lora import expand, shrink  # noqa: E402

DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] != "0" else "cuda"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [  # tokens, in, out, rank rows (parts x max rank), slots
    (7, 576, 960, 48, 4), (1, 64, 96, 20, 2), (5, 100, 40, 3, 3), (0, 576, 960, 48, 2)]
SLOTS = {7: [2, -1, 0, 2, 2, -1, 0], 1: [1], 5: [-1, -1, 2, -1, -1], 0: []}
"""Per token count: slots in no order, repeated, mixed with the base model's -1; slot 1 of
the first shape, 0 of the second, 0 and 1 of the third, are nobody's."""


def close_in(dtype: torch.dtype) -> dict[str, float]:
    """fp32: the fp32 sums differ from fp64 in the last bits; half types: one rounding of
    the result (the interpreter's casts need not round to nearest even as torch's do)."""
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def lora_case(shape: tuple[int, ...], dtype: torch.dtype, slot_dtype=torch.int32):
    """x (a strided view: the first columns of a wider tensor), a, bt, token_slots, with
    NaN in the slots no token uses. The weights are scaled so that s and the delta are
    about unit-sized, as an absolute tolerance assumes."""
    tokens, in_dim, out_dim, rank_rows, num_slots = shape
    gen = torch.Generator().manual_seed(in_dim * out_dim + rank_rows)
    x = torch.randn(tokens, in_dim + 8, generator=gen).to(dtype)[:, :in_dim]
    a = (torch.randn(num_slots, rank_rows, in_dim, generator=gen) / in_dim**0.5).to(dtype)
    bt = torch.randn(num_slots, rank_rows, out_dim, generator=gen) / rank_rows**0.5
    bt = bt.to(dtype)
    token_slots = torch.tensor(SLOTS[tokens], dtype=slot_dtype)
    unused = sorted(set(range(num_slots)) - set(SLOTS[tokens]))
    a[unused], bt[unused] = float("nan"), float("nan")
    return x, a, bt, token_slots


def shrink_ref(x, a, token_slots) -> torch.Tensor:
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            out[t] = x[t].double() @ a[slot].double().T
    return out


def expand_ref(s, bt, token_slots, y) -> torch.Tensor:
    out = y.double().clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            out[t] += s[t].double() @ bt[slot].double()
    return out


def dev(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_shrink_matches_torch(dtype, shape) -> None:
    x, a, _, token_slots = lora_case(shape, dtype)
    out = shrink(*dev(x, a, token_slots))
    assert out.shape == (shape[0], shape[3]) and out.dtype == dtype
    assert torch.isfinite(out).all(), "a poisoned slot leaked"
    torch.testing.assert_close(out.cpu().double(), shrink_ref(x, a, token_slots),
                               **close_in(dtype))
    base = token_slots == -1
    assert (out.cpu()[base] == 0).all(), "a base-model token's row is not zero"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_expand_adds_into_one_part_of_a_fused_output(dtype, shape) -> None:
    """y is the first part's columns of a wider fused output (q of qkv): those columns
    of the adapters' tokens change, nothing else does, not by a bit."""
    x, _, bt, token_slots = lora_case(shape, dtype, torch.int64)
    tokens, _, out_dim, rank_rows, _ = shape
    gen = torch.Generator().manual_seed(out_dim)
    s = torch.randn(tokens, rank_rows, generator=gen).to(dtype)
    full = torch.randn(tokens, out_dim + 24, generator=gen).to(dtype)
    want = expand_ref(s, bt, token_slots, full[:, :out_dim])
    full_dev = full.to(DEVICE)
    expand(*dev(s, bt, token_slots), full_dev[:, :out_dim])
    got = full_dev.cpu()
    assert torch.isfinite(got).all(), "a poisoned slot leaked"
    torch.testing.assert_close(got[:, :out_dim].double(), want, **close_in(dtype))
    base = token_slots == -1
    assert torch.equal(got[base], full[base]), "a base-model token's row changed"
    assert torch.equal(got[:, out_dim:], full[:, out_dim:]), "columns past y changed"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shrink_then_expand_is_the_lora_delta(dtype) -> None:
    """The two together: `y + (x @ A.T) @ (scaled B).T` per token, with s rounded to the
    activations' dtype in between, as shrink returns it."""
    x, a, bt, token_slots = lora_case(SHAPES[0], dtype)
    y = torch.randn(x.shape[0], bt.shape[2], generator=torch.Generator().manual_seed(1))
    y = y.to(dtype)
    want = expand_ref(shrink_ref(x, a, token_slots).to(dtype), bt, token_slots, y)
    y_dev = y.to(DEVICE)
    x_dev, a_dev, bt_dev, slots_dev = dev(x, a, bt, token_slots)
    expand(shrink(x_dev, a_dev, slots_dev), bt_dev, slots_dev, y_dev)
    torch.testing.assert_close(y_dev.cpu().double(), want, **close_in(dtype))


def test_bad_shapes_are_refused() -> None:
    x, a = torch.zeros(3, 16), torch.zeros(2, 8, 16)
    s, bt, y = torch.zeros(3, 8), torch.zeros(2, 8, 24), torch.zeros(3, 24)
    slots = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"must be \[T, dim\]"):
        shrink(x[None], a, slots)
    with pytest.raises(ValueError, match=r"must be \[S, PR, IN\]"):
        shrink(x, a[:, :, :15], slots)
    with pytest.raises(ValueError, match="one dtype"):
        shrink(x, a.double(), slots)
    with pytest.raises(ValueError, match="slot per token"):
        shrink(x, a, slots[:2])
    with pytest.raises(ValueError, match="slot per token"):
        shrink(x, a, slots.float())
    with pytest.raises(ValueError, match="contiguous last axis"):
        shrink(torch.zeros(3, 32)[:, ::2], a, slots)
    with pytest.raises(ValueError, match=r"must be \[S, PR, OUT\]"):
        expand(s, bt[:, :7], slots, y)
    with pytest.raises(ValueError, match=r"y \(3, 23\)"):
        expand(s, bt, slots, y[:, :23])
    with pytest.raises(ValueError, match="in their dtype"):
        expand(s, bt, slots, y.half())
    with pytest.raises(ValueError, match="y needs a contiguous last axis"):
        expand(s, bt, slots, torch.zeros(3, 48)[:, ::2])


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_kernels_replay_in_a_cuda_graph() -> None:
    """Captured once at fixed shapes, replayed with new tokens and slots written into the
    captured inputs: the replay gives what an eager call gives."""
    x, a, bt, token_slots = (t.cuda() for t in lora_case(SHAPES[0], torch.bfloat16))
    y = torch.zeros(x.shape[0], bt.shape[2], dtype=x.dtype, device="cuda")
    expand(shrink(x, a, token_slots), bt, token_slots, y)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        expand(shrink(x, a, token_slots), bt, token_slots, y)
    x.copy_(torch.randn_like(x))
    token_slots.copy_(token_slots.flip(0))
    y.zero_()
    graph.replay()
    want = torch.zeros_like(y)
    expand(shrink(x, a, token_slots), bt, token_slots, want)
    torch.testing.assert_close(y, want, rtol=0, atol=0)
