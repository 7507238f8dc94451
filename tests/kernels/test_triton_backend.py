"""`TritonAttentionBackend` against `TorchAttentionBackend` on whole forward steps.

Runs on the CPU under `TRITON_INTERPRET=1` (set before triton is imported). Each step
stores the new tokens' K/V and attends, over two layers with their own caches, for an
all-decode step, an all-extend step and a mixed step (decodes next to extends with cached
prefixes); both backends must leave identical caches and give the same output.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from radixserve.worker.attention import (  # noqa: E402
    AttentionMetadata, TorchAttentionBackend, create_backend)
from radixserve.worker.attention_triton import (  # noqa: E402
    TritonAttentionBackend, interpreting)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA device", allow_module_level=True)
if INTERPRET != interpreting():
    raise RuntimeError("radixserve.kernels was imported before TRITON_INTERPRET was set: "
                       "export TRITON_INTERPRET=1 (CPU) or 0 (GPU) for the whole test run")
PAGE, HKV, GROUP, D, LAYERS = 16, 2, 3, 64, 2


def make_step(seqs: list[tuple[int, int]], num_blocks: int = 40,
              seed: int = 0) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata for `seqs` = (cached prefix, new tokens) and random cache contents for
    two layers (`[LAYERS, 2, num_blocks, PAGE, HKV, D]`: the cached prefixes)."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-(p + n) // PAGE) for p, n in seqs) + 1
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    slots: list[int] = []
    for b, (prefix, new) in enumerate(seqs):
        blocks = [perm.pop() for _ in range(-(-(prefix + new) // PAGE))]
        tables[b, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[t // PAGE] * PAGE + t % PAGE for t in range(prefix, prefix + new)]
    q_lens = torch.tensor([n for _, n in seqs], dtype=torch.int32)
    kv_lens = torch.tensor([p + n for p, n in seqs], dtype=torch.int32)
    q_start = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    q_start[1:] = torch.cumsum(q_lens, 0)
    meta = AttentionMetadata(
        q_start=q_start.to(DEVICE), q_lens=q_lens.to(DEVICE), kv_lens=kv_lens.to(DEVICE),
        block_tables=tables.to(DEVICE), slot_mapping=torch.tensor(slots).to(DEVICE),
        max_q_len=int(q_lens.max()), max_kv_len=int(kv_lens.max()), page_size=PAGE)
    caches = torch.randn(LAYERS, 2, num_blocks, PAGE, HKV, D, generator=gen)
    return meta, caches.to(DEVICE)


def run_step(backend: TorchAttentionBackend | TritonAttentionBackend, meta: AttentionMetadata,
             caches: torch.Tensor, seed: int = 1) -> list[torch.Tensor]:
    """One forward over all layers; q/k/v are strided slices of a fused qkv, as in a model."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = meta.slot_mapping.shape[0]
    backend.begin_forward(meta)
    outs = []
    for layer in range(LAYERS):
        qkv = torch.randn(num_tokens, HKV * (GROUP + 2), D, generator=gen).to(DEVICE)
        q, k, v = qkv.split([HKV * GROUP, HKV, HKV], dim=1)
        outs.append(backend.forward(q, k, v, caches[layer, 0], caches[layer, 1], D ** -0.5))
    return outs


@pytest.mark.parametrize("seqs", [
    [(15, 1), (0, 1), (16, 1), (40, 1)],
    [(0, 17), (16, 16), (5, 30)],
    [(20, 1), (0, 17), (31, 1), (16, 33), (32, 1), (3, 1), (47, 2)],
], ids=["all-decode", "all-extend", "mixed"])
def test_triton_backend_matches_torch(seqs: list[tuple[int, int]]) -> None:
    meta, caches = make_step(seqs)
    torch_caches, triton_caches = caches.clone(), caches.clone()
    expected = run_step(TorchAttentionBackend(), meta, torch_caches)
    got = run_step(create_backend("triton", DEVICE), meta, triton_caches)
    torch.testing.assert_close(triton_caches, torch_caches, rtol=0, atol=0)
    for want, out in zip(expected, got):
        assert torch.isfinite(out).all()
        assert float((out - want).abs().max() / want.abs().max()) <= 1e-5


def test_create_backend_triton() -> None:
    assert isinstance(create_backend("triton", DEVICE), TritonAttentionBackend)
