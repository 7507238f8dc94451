"""`TritonAttentionBackend` against `TorchAttentionBackend` on whole forward steps.

Runs on the CPU under `TRITON_INTERPRET=1` (set before triton is imported). Each step
stores the new tokens' K/V and attends, over two layers with their own caches, for an
all-decode step, an all-extend step and a mixed step (decodes next to extends with cached
prefixes); both backends must leave identical caches and give the same output. Steps over
random prefix trees (`tests.factories.random_tree_step`) check tree (cascade) attention:
the Triton backend with the step's plan against the torch backend with the same plan, and
against plain attention.
"""

from __future__ import annotations

import dataclasses
import os
import random

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from radixserve.worker.attention.base import AttentionMetadata  # noqa: E402
from radixserve.worker.attention.registry import create_backend  # noqa: E402
from radixserve.worker.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from radixserve.worker.attention.triton_backend import (  # noqa: E402
    TritonAttentionBackend, interpreting)
from radixserve.worker.cascade import CascadeOptions, plan_cascade  # noqa: E402
from tests.factories import TreeStep, random_tree_step  # noqa: E402

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


# ---------------------------------------------------------------------------- tree attention

CASCADE = CascadeOptions(max_levels=3, min_shared_tokens=1, min_group_size=2)


def on_device(meta: AttentionMetadata) -> AttentionMetadata:
    return dataclasses.replace(meta, **{
        f.name: getattr(meta, f.name).to(DEVICE) for f in dataclasses.fields(meta)
        if isinstance(getattr(meta, f.name), torch.Tensor)})


def planned(step: TreeStep) -> tuple[AttentionMetadata, torch.Tensor]:
    """`step`'s metadata with its cascade plan, and random caches for `LAYERS` layers."""
    plan = plan_cascade(step.block_tables, step.kv_lens, step.q_lens, step.page_size, CASCADE)
    caches = torch.stack([torch.stack(step.caches(HKV * GROUP, seed=layer))
                          for layer in range(LAYERS)])
    return on_device(step.metadata(plan)), caches.to(DEVICE)


def tree_step(rng: random.Random, page: int, **kwargs) -> tuple[TreeStep, AttentionMetadata,
                                                                 torch.Tensor]:
    """A random prefix-tree step, planned."""
    step = random_tree_step(rng, page_size=page, num_kv_heads=HKV, head_dim=D, **kwargs)
    return step, *planned(step)


def check_cascade_step(meta: AttentionMetadata, caches: torch.Tensor) -> None:
    """Triton with the plan == torch with the plan == plain attention (torch, no plan),
    and both backends leave the same caches."""
    assert meta.cascade is not None
    plain = dataclasses.replace(meta, cascade=None)
    stores = {name: caches.clone() for name in ("torch", "triton", "plain")}
    expected = run_step(TorchAttentionBackend(), meta, stores["torch"])
    truth = run_step(TorchAttentionBackend(), plain, stores["plain"])
    backend = create_backend("triton", DEVICE)
    got = run_step(backend, meta, stores["triton"])
    assert backend.cascade is not None  # the tree path ran
    torch.testing.assert_close(stores["triton"], stores["torch"], rtol=0, atol=0)
    for want, plain_out, out in zip(expected, truth, got):
        assert torch.isfinite(out).all()
        scale = want.abs().max()
        assert float((out - want).abs().max() / scale) <= 1e-5
        assert float((out - plain_out).abs().max() / scale) <= 1e-5


@pytest.mark.parametrize("levels", [1, 2, 3])
@pytest.mark.parametrize("page", [4, 16])
def test_triton_cascade_matches_torch(page: int, levels: int) -> None:
    """Random trees, decodes and extend chunks mixed: runs end on page boundaries, most
    own parts mid-page; one root (all share a run) or a few."""
    rng = random.Random(page * 100 + levels)
    depths = []
    for trial in range(3):
        step, meta, caches = tree_step(rng, page, levels=levels, num_seqs=rng.randint(6, 14),
                                       roots=1 if trial < 2 else None, extend_share=0.5)
        assert 1 in step.q_lens and set(step.q_lens) - {1}
        depths.append(len(meta.cascade.levels))
        check_cascade_step(meta, caches)
    assert max(depths) == levels


def test_triton_cascade_page_size_one() -> None:
    _, meta, caches = tree_step(random.Random(1), 1, levels=2, num_seqs=9, roots=1,
                                extend_share=0.5)
    check_cascade_step(meta, caches)


def test_triton_cascade_all_decode() -> None:
    """Every sequence a decode (the common serving step: a shared system prompt), beside
    sequences that share nothing (the plain decodes of a cascade step)."""
    rng = random.Random(2)
    step = random_tree_step(rng, page_size=16, levels=2, num_seqs=8, roots=1,
                            num_kv_heads=HKV, head_dim=D)
    for _ in range(2):
        step = step.concat(random_tree_step(rng, page_size=16, levels=1, num_seqs=1,
                                            num_kv_heads=HKV, head_dim=D))
    meta, caches = planned(step)
    assert set(step.q_lens) == {1} and min(meta.cascade.own_start) == 0
    check_cascade_step(meta, caches)


def test_plain_step_builds_no_cascade_state() -> None:
    meta, caches = make_step([(15, 1), (0, 17)])
    backend = create_backend("triton", DEVICE)
    run_step(backend, meta, caches)
    assert backend.cascade is None


def test_gpu_check_cascade_step_on_cpu() -> None:
    """bench/gpu/run.py's tree-attention step, shrunk: one level of one run per group,
    the KV bytes it reports, and the Triton backend agreeing with and without the plan."""
    from bench.gpu.kernels import cascade_decode_step

    step = cascade_decode_step(2, 3, 100, 20, PAGE, HKV, GROUP, D, torch.float32, DEVICE,
                               torch.Generator(device=DEVICE).manual_seed(0))
    plan = step["cascade"].cascade
    assert step["levels"] == 1 and [len(run.seqs) for run in plan.levels[0]] == [3, 3]
    assert all(len(run.blocks) == 100 // PAGE for run in plan.levels[0])
    kv_token = HKV * D * 2 * 4
    assert step["plain_bytes"] == 6 * 120 * kv_token
    assert step["cascade_bytes"] == (2 * 96 + 6 * 24) * kv_token
    outs = []
    for mode in ("plain", "cascade"):
        backend = create_backend("triton", DEVICE)
        backend.begin_forward(step[mode])
        outs.append(backend.forward(step["q"], step["k"], step["v"], step["k_cache"].clone(),
                                    step["v_cache"].clone(), D ** -0.5))
    assert float((outs[1] - outs[0]).abs().max() / outs[0].abs().max()) <= 1e-5
