"""`TritonAttentionBackend` against `TorchAttentionBackend` on whole forward steps.

Runs on the CPU under `TRITON_INTERPRET=1` (set before triton is imported). Each step
stores the new tokens' K/V and attends, over two layers with their own caches, for an
all-decode step, an all-extend step and a mixed step (decodes next to extends with cached
prefixes); both backends must leave identical caches and give the same output. Steps over
random prefix trees check tree (cascade) attention: the Triton backend with the step's
cascade plan against the torch backend with the same plan, and against plain attention.
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from radixserve.worker.attention import (  # noqa: E402
    AttentionMetadata, TorchAttentionBackend, create_backend)
from radixserve.worker.attention_triton import (  # noqa: E402
    TritonAttentionBackend, interpreting)
from radixserve.worker.cascade import CascadeOptions, CascadePlan, plan_cascade  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA device", allow_module_level=True)
if INTERPRET != interpreting():
    raise RuntimeError("radixserve.kernels was imported before TRITON_INTERPRET was set: "
                       "export TRITON_INTERPRET=1 (CPU) or 0 (GPU) for the whole test run")
PAGE, HKV, GROUP, D, LAYERS = 16, 2, 3, 64, 2


def step_metadata(tables: list[list[int]], kv_lens: list[int], q_lens: list[int],
                  page: int = PAGE, cascade: CascadePlan | None = None) -> AttentionMetadata:
    """The metadata of a step whose sequence b has blocks `tables[b]`, `kv_lens[b]` tokens
    once its `q_lens[b]` new ones (the last) are stored."""
    width = max(len(t) for t in tables) + 1
    table = torch.zeros(len(tables), width, dtype=torch.int32)
    slots: list[int] = []
    for b, (blocks, kv, new) in enumerate(zip(tables, kv_lens, q_lens)):
        table[b, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[t // page] * page + t % page for t in range(kv - new, kv)]
    q_start = torch.zeros(len(tables) + 1, dtype=torch.int32)
    q_start[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    return AttentionMetadata(
        q_start=q_start.to(DEVICE), q_lens=torch.tensor(q_lens, dtype=torch.int32).to(DEVICE),
        kv_lens=torch.tensor(kv_lens, dtype=torch.int32).to(DEVICE),
        block_tables=table.to(DEVICE), slot_mapping=torch.tensor(slots).to(DEVICE),
        max_q_len=max(q_lens), max_kv_len=max(kv_lens), page_size=page, cascade=cascade)


def make_step(seqs: list[tuple[int, int]], num_blocks: int = 40,
              seed: int = 0) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata for `seqs` = (cached prefix, new tokens) and random cache contents for
    two layers (`[LAYERS, 2, num_blocks, PAGE, HKV, D]`: the cached prefixes)."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(-(-(p + n) // PAGE))] for p, n in seqs]
    meta = step_metadata(tables, [p + n for p, n in seqs], [n for _, n in seqs])
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


class PrefixTree:
    """A random step over a tree of shared prefixes, `depth` levels deep: each node adds
    whole blocks (page-aligned, so every shared run ends on a page boundary) shared by all
    the sequences below it, and each node has `branching` children (2..3 when None);
    every leaf sequence adds its own part: a few cached tokens (0 to 2 pages, so it often
    ends mid-page) and new tokens, one (a decode) or a chunk of several (an extend, which
    may cross pages). Two sequences share nothing (plain decode and extend). Block ids
    are a random permutation (runs scattered over the pool) or, with `contiguous`, in
    order (runs read in place by the torch reference)."""

    def __init__(self, depth: int, page: int, seed: int, contiguous: bool = False,
                 branching: int | None = None):
        gen = torch.Generator().manual_seed(seed)

        def rnd(lo: int, hi: int) -> int:
            return int(torch.randint(lo, hi + 1, (1,), generator=gen))

        unit = max(1, 16 // page)  # blocks per 16 tokens
        logical: list[tuple[list[int], int, int]] = []  # (blocks, kv_len, new tokens)
        count = 0

        def new_blocks(n: int) -> list[int]:
            nonlocal count
            count += n
            return list(range(count - n, count))

        def own_part(prefix: list[int], new: int) -> None:
            cached = rnd(0, 2 * page)
            blocks = prefix + new_blocks(-(-(cached + new) // page))
            logical.append((blocks, len(prefix) * page + cached + new, new))

        def chunk() -> int:
            return 1 if rnd(0, 1) else rnd(2, page + 3)

        def node(level: int, prefix: list[int]) -> None:
            blocks = prefix + new_blocks(rnd(1, 3) * unit)
            for _ in range(branching or rnd(2, 3)):
                if level + 1 < depth:
                    node(level + 1, blocks)
                else:
                    own_part(blocks, chunk())

        for _ in range(rnd(1, 2)):
            node(0, [])
        own_part([], 1)
        own_part([], rnd(2, page + 3))
        order = torch.randperm(len(logical), generator=gen).tolist()
        ids = list(range(count)) if contiguous else torch.randperm(count, generator=gen).tolist()
        self.tables = [[ids[b] for b in logical[i][0]] for i in order]
        self.kv_lens = [logical[i][1] for i in order]
        self.q_lens = [logical[i][2] for i in order]
        self.page = page
        self.plan = plan_cascade(self.tables, self.kv_lens, self.q_lens, page, CASCADE)
        self.meta = step_metadata(self.tables, self.kv_lens, self.q_lens, page, self.plan)
        self.caches = torch.randn(LAYERS, 2, count + 1, page, HKV, D, generator=gen).to(DEVICE)


def check_cascade_step(tree: PrefixTree) -> None:
    """Triton with the plan == torch with the plan == plain attention (torch, no plan)."""
    assert tree.plan is not None
    plain = dataclasses.replace(tree.meta, cascade=None)
    caches = {name: tree.caches.clone() for name in ("torch", "triton", "plain")}
    expected = run_step(TorchAttentionBackend(), tree.meta, caches["torch"])
    truth = run_step(TorchAttentionBackend(), plain, caches["plain"])
    backend = create_backend("triton", DEVICE)
    got = run_step(backend, tree.meta, caches["triton"])
    assert backend.cascade is not None  # the tree path ran
    torch.testing.assert_close(caches["triton"], caches["torch"], rtol=0, atol=0)
    for want, plain_out, out in zip(expected, truth, got):
        assert torch.isfinite(out).all()
        scale = want.abs().max()
        assert float((out - want).abs().max() / scale) <= 1e-5
        assert float((out - plain_out).abs().max() / scale) <= 1e-5


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("page", [4, 16])
def test_triton_cascade_matches_torch(page: int, depth: int, seed: int) -> None:
    tree = PrefixTree(depth, page, seed=100 * page + 10 * depth + seed, contiguous=seed == 1,
                      branching=2 if depth == 3 else None)
    assert len(tree.plan.levels) == depth  # every node branches: one level per tree level
    assert set(tree.q_lens) - {1} and 1 in tree.q_lens  # decodes and extends mixed
    check_cascade_step(tree)


def test_triton_cascade_page_size_one() -> None:
    check_cascade_step(PrefixTree(2, 1, seed=7))


def test_triton_cascade_all_decode() -> None:
    """Every sequence a decode (the common serving step: a shared system prompt)."""
    tree = PrefixTree(2, 16, seed=3)
    decode = [1] * len(tree.q_lens)
    kv_lens = [kv - q + 1 for kv, q in zip(tree.kv_lens, tree.q_lens)]
    tree.plan = plan_cascade(tree.tables, kv_lens, decode, 16, CASCADE)
    tree.meta = step_metadata(tree.tables, kv_lens, decode, 16, tree.plan)
    check_cascade_step(tree)


def test_plain_step_builds_no_cascade_state() -> None:
    meta, caches = make_step([(15, 1), (0, 17)])
    backend = create_backend("triton", DEVICE)
    run_step(backend, meta, caches)
    assert backend.cascade is None


def test_gpu_check_cascade_step_on_cpu() -> None:
    """bench/gpu_check.py's tree-attention step, shrunk: one level of one run per group,
    the KV bytes it reports, and the Triton backend agreeing with and without the plan."""
    from bench.gpu_check import cascade_decode_step

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
