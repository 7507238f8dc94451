"""Triton kernels against their torch references (fp32, max relative error <= 1e-5).

Runs on the CPU under `TRITON_INTERPRET=1` (set here before triton is imported); with
`TRITON_INTERPRET=0` on a CUDA machine the same tests run on the GPU. Shapes stay small:
the interpreter executes each program in Python. Relative error is normwise:
`max|out - ref| / max|ref|`. Unwritten output is caught by NaN poison: outputs and the
split workspace start as NaN, and cache slots no sequence owns are NaN for the kernels
(the references get a clean copy, since they read padding and mask it afterwards).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from radixserve.kernels import cascade_attention as cascade_mod  # noqa: E402
from radixserve.kernels import decode_attention as decode_mod  # noqa: E402
from radixserve.kernels.cascade_attention import (  # noqa: E402
    cascade_level_attention, merge_attention_states_, run_offsets)
from radixserve.kernels.decode_attention import (  # noqa: E402
    choose_num_splits, paged_decode_attention)
from radixserve.kernels.extend_attention import extend_attention  # noqa: E402
from radixserve.kernels.store_kv import store_kv  # noqa: E402
from radixserve.worker.attention import paged_torch as reference  # noqa: E402
from radixserve.worker.attention.triton_backend import interpreting  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cpu" if INTERPRET else "cuda"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA device", allow_module_level=True)
if INTERPRET != interpreting():
    raise RuntimeError("radixserve.kernels was imported before TRITON_INTERPRET was set: "
                       "export TRITON_INTERPRET=1 (CPU) or 0 (GPU) for the whole test run")
TOL = 1e-5
HEAD_DIM = 64


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "NaN/inf in the output: a row was not written"
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


class Paged:
    """A random paged KV layout: shuffled distinct blocks per sequence, NaN everywhere no
    sequence owns (unused blocks and the tail of each last block), -1 table padding."""

    def __init__(self, kv_lens: list[int], page_size: int, num_kv_heads: int,
                 head_dim: int = HEAD_DIM, seed: int = 0, extra_cols: int = 2):
        gen = torch.Generator().manual_seed(seed)
        need = [-(-n // page_size) for n in kv_lens]
        num_blocks = sum(need) + 3
        shape = (num_blocks, page_size, num_kv_heads, head_dim)
        self.k_clean = torch.randn(shape, generator=gen)
        self.v_clean = torch.randn(shape, generator=gen)
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        width = max(need) + extra_cols
        self.block_tables = torch.full((len(kv_lens), width), -1, dtype=torch.int32)
        owned = torch.zeros(num_blocks * page_size, dtype=torch.bool)
        for b, (n, nb) in enumerate(zip(kv_lens, need)):
            blocks = [perm.pop() for _ in range(nb)]
            self.block_tables[b, :nb] = torch.tensor(blocks, dtype=torch.int32)
            for t in range(n):
                owned[blocks[t // page_size] * page_size + t % page_size] = True
        poison = ~owned.view(num_blocks, page_size, 1, 1)
        self.k = self.k_clean.masked_fill(poison, float("nan")).to(DEVICE)
        self.v = self.v_clean.masked_fill(poison, float("nan")).to(DEVICE)
        self.ref_tables = self.block_tables.clamp(min=0)  # the reference reads padding
        self.kv_lens = torch.tensor(kv_lens, dtype=torch.int32)


def boundary_lengths(page_size: int, rng: torch.Generator, extra: int) -> list[int]:
    """1, exactly on a page boundary, just past one, plus random lengths; shuffled."""
    lens = [1, page_size, page_size + 1, 2 * page_size, 2 * page_size + 1]
    lens += torch.randint(1, 160, (extra,), generator=rng).tolist()
    return [lens[i] for i in torch.randperm(len(lens), generator=rng)]


# ---------------------------------------------------------------------------- store_kv

@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_store_kv_matches_reference(page_size: int, slot_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(page_size)
    num_blocks, hkv, d, t = 32, 3, HEAD_DIM, 21
    shape = (num_blocks, page_size, hkv, d)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    slots = torch.randperm(num_blocks * page_size, generator=gen)[:t]
    qkv = torch.randn(t, 3 * hkv, d, generator=gen)  # k, v as strided slices
    k, v = qkv[:, hkv:2 * hkv], qkv[:, 2 * hkv:]
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(ref_k, ref_v, slots, k.contiguous(), v.contiguous())
    k_dev, v_dev = k_cache.to(DEVICE), v_cache.to(DEVICE)
    store_kv(k_dev, v_dev, slots.to(slot_dtype).to(DEVICE), k.to(DEVICE), v.to(DEVICE))
    torch.testing.assert_close(k_dev.cpu(), ref_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_dev.cpu(), ref_v, rtol=0, atol=0, equal_nan=True)


def test_store_kv_skips_negative_slots() -> None:
    k_cache = torch.zeros(4, 16, 2, HEAD_DIM, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k = torch.ones(3, 2, HEAD_DIM, device=DEVICE)
    store_kv(k_cache, v_cache, torch.tensor([5, -1, 40], device=DEVICE), k, 2 * k)
    flat_k, flat_v = k_cache.view(-1, 2, HEAD_DIM), v_cache.view(-1, 2, HEAD_DIM)
    assert flat_k[5].eq(1).all() and flat_k[40].eq(1).all() and flat_v[40].eq(2).all()
    assert flat_k.sum() == 2 * 2 * HEAD_DIM


# ---------------------------------------------------------------------------- decode

def _check_decode(lens: list[int], page_size: int, group: int, num_kv_heads: int,
                  num_splits: int | None, head_dim: int = HEAD_DIM, seed: int = 0,
                  max_kv_len: int | None = None, window: int | None = None) -> None:
    paged = Paged(lens, page_size, num_kv_heads, head_dim, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen)
    scale = head_dim ** -0.5
    ref = reference.paged_decode_attention(q, paged.k_clean, paged.v_clean, paged.ref_tables,
                                           paged.kv_lens, scale, window=window)
    out = torch.full_like(q, float("nan"), device=DEVICE)
    paged_decode_attention(q.to(DEVICE), paged.k, paged.v, paged.block_tables.to(DEVICE),
                           paged.kv_lens.to(DEVICE), scale, num_splits=num_splits,
                           max_kv_len=max_kv_len, out=out, window=window)
    assert rel_err(out.cpu(), ref) <= TOL


def poison_workspace(monkeypatch: pytest.MonkeyPatch, module) -> None:
    """`module`'s split-KV scratch starts as NaN, so a merge that reads an unwritten split
    fails."""
    monkeypatch.setattr(module, "_workspace", lambda shape, device: torch.full(
        shape, float("nan"), dtype=torch.float32, device=device))


@pytest.fixture
def poisoned_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    poison_workspace(monkeypatch, decode_mod)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-pass", "split-kv"])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_decode_matches_reference(page_size: int, group: int, num_splits: int,
                                  poisoned_workspace: None) -> None:
    rng = torch.Generator().manual_seed(page_size * 10 + group)
    lens = boundary_lengths(page_size, rng, extra=2)
    _check_decode(lens, page_size, group, num_kv_heads=2, num_splits=num_splits,
                  seed=page_size + group)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-pass", "split-kv"])
@pytest.mark.parametrize("window", [1, 5, 64, 1000])
def test_decode_sliding_window(window: int, num_splits: int, poisoned_workspace: None) -> None:
    """Only the last `window` keys: shorter, equal and longer contexts, across pages and
    splits (the splits cut the window's range, none of them empty)."""
    lens = [1, 4, 5, 6, 17, 63, 64, 65, 130, 700, 1100]
    _check_decode(lens, 16, 3, num_kv_heads=2, num_splits=num_splits, seed=window,
                  window=window)
    _check_decode(lens[:6], 1, 1, num_kv_heads=2, num_splits=num_splits, seed=window + 1,
                  window=window)


def test_decode_default_output_and_single_sequence() -> None:
    paged = Paged([37], 16, 1)
    q = torch.randn(1, 3, HEAD_DIM)
    ref = reference.paged_decode_attention(q, paged.k_clean, paged.v_clean, paged.ref_tables,
                                           paged.kv_lens, 0.1)
    out = paged_decode_attention(q.to(DEVICE), paged.k, paged.v, paged.block_tables.to(DEVICE),
                                 paged.kv_lens.to(DEVICE), 0.1)
    assert rel_err(out.cpu(), ref) <= TOL


@pytest.mark.parametrize("head_dim", [128, 80])
def test_decode_head_dims(head_dim: int, poisoned_workspace: None) -> None:
    _check_decode([1, 16, 17, 90], 16, 2, num_kv_heads=2, num_splits=2, head_dim=head_dim)


def test_decode_split_heuristic_path(poisoned_workspace: None) -> None:
    """The default split choice splits a small batch of long contexts; a big batch not."""
    assert choose_num_splits(2, 1, 1100, num_sms=132) == 2
    assert choose_num_splits(64, 8, 4096, num_sms=132) == 1
    assert choose_num_splits(64, 3, 4096, num_sms=132) == 2
    assert choose_num_splits(4, 8, 300, num_sms=132) == 1
    _check_decode([1100, 513], 16, 2, num_kv_heads=1, num_splits=None, max_kv_len=1100)


def nan_like(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=torch.float32, device=DEVICE)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-pass", "split-kv"])
@pytest.mark.parametrize("group", [1, 8])
def test_decode_return_lse(group: int, num_splits: int, poisoned_workspace: None) -> None:
    """fp32 output and natural log-sum-exp, as the reference gives them (the own parts of
    tree attention); into the caller's buffers or fresh ones."""
    lens = [1, 16, 17, 150, 70]
    paged = Paged(lens, 16, 2, seed=group)
    q = torch.randn(len(lens), 2 * group, HEAD_DIM, generator=torch.Generator().manual_seed(3))
    ref_o, ref_lse = reference.paged_decode_attention(
        q, paged.k_clean, paged.v_clean, paged.ref_tables, paged.kv_lens, 0.125,
        return_lse=True)
    args = (q.to(DEVICE), paged.k, paged.v, paged.block_tables.to(DEVICE),
            paged.kv_lens.to(DEVICE), 0.125)
    out, lse = nan_like(tuple(q.shape)), nan_like(tuple(q.shape[:2]))
    got = paged_decode_attention(*args, num_splits=num_splits, out=out, lse_out=lse,
                                 return_lse=True)
    assert got[0] is out and got[1] is lse
    fresh = paged_decode_attention(*args, num_splits=num_splits, return_lse=True)
    for o, lse in (got, fresh):
        assert o.dtype == lse.dtype == torch.float32
        assert rel_err(o.cpu(), ref_o) <= TOL and rel_err(lse.cpu(), ref_lse) <= TOL
    with pytest.raises(ValueError, match="float32"):
        paged_decode_attention(*args, out=out.half(), return_lse=True)


# ---------------------------------------------------------------------------- extend

def _check_extend(seqs: list[tuple[int, int]], page_size: int, group: int,
                  num_kv_heads: int = 2, head_dim: int = HEAD_DIM, seed: int = 0,
                  window: int | None = None) -> None:
    """`seqs`: (cached prefix, new tokens) per sequence."""
    kv_lens = [p + n for p, n in seqs]
    paged = Paged([max(n, 1) for n in kv_lens], page_size, num_kv_heads, head_dim, seed=seed)
    paged.kv_lens = torch.tensor(kv_lens, dtype=torch.int32)
    q_start = torch.tensor([0] + [n for _, n in seqs]).cumsum(0).to(torch.int32)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(int(q_start[-1]), num_kv_heads * group, head_dim, generator=gen)
    scale = head_dim ** -0.5
    ref = reference.extend_attention(q, paged.k_clean, paged.v_clean, paged.ref_tables,
                                     q_start, paged.kv_lens, scale, window=window)
    out = torch.full_like(q, float("nan"), device=DEVICE)
    extend_attention(q.to(DEVICE), paged.k, paged.v, paged.block_tables.to(DEVICE),
                     q_start.to(DEVICE), paged.kv_lens.to(DEVICE), scale, out=out,
                     window=window)
    assert rel_err(out.cpu(), ref) <= TOL


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_matches_reference(page_size: int, group: int) -> None:
    rng = torch.Generator().manual_seed(page_size * 10 + group)
    p = page_size
    seqs = [(0, 1), (0, p), (0, p + 1), (p, p), (p, 1), (p - 1, 2), (2 * p + 1, 3),
            (int(torch.randint(0, 90, (1,), generator=rng)), 70), (100, 17)]
    order = torch.randperm(len(seqs), generator=rng).tolist()
    _check_extend([seqs[i] for i in order], page_size, group, seed=p + group)


@pytest.mark.parametrize("window", [1, 7, 32, 100])
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_sliding_window(page_size: int, window: int) -> None:
    """Chunks whose rows' windows start in the cached prefix, inside the chunk, or cover
    everything; tiles whose first row's window starts mid-tile."""
    p = page_size
    seqs = [(0, 1), (0, 40), (5, 70), (p, p + 3), (90, 17), (130, 1), (31, 33), (0, 130)]
    _check_extend(seqs, page_size, 3, seed=window + p, window=window)


def test_extend_short_chunks_and_empty_sequence() -> None:
    """Small query tiles (max_q_len <= 16) and a sequence with no new tokens."""
    _check_extend([(5, 3), (0, 16), (40, 0), (16, 1)], 16, 3)


@pytest.mark.parametrize("head_dim", [128, 80])
def test_extend_head_dims(head_dim: int) -> None:
    _check_extend([(0, 17), (16, 16), (33, 1)], 16, 2, head_dim=head_dim)


def test_extend_subset_by_q_lens() -> None:
    """`q_lens` + per-sequence starts address a subset of the packed rows in place; the
    rows of other sequences are left untouched."""
    paged = Paged([20, 9, 33], 16, 1)
    q_start = torch.tensor([0, 4, 5, 21], dtype=torch.int32)  # seq 1 is a decode row
    q = torch.randn(21, 2, HEAD_DIM)
    ref = reference.extend_attention(q, paged.k_clean, paged.v_clean, paged.ref_tables,
                                     q_start, paged.kv_lens, 0.125)
    sub = torch.tensor([0, 2])
    out = torch.full_like(q, float("nan"), device=DEVICE)
    extend_attention(q.to(DEVICE), paged.k, paged.v, paged.block_tables[sub].to(DEVICE),
                     q_start[sub].to(DEVICE), paged.kv_lens[sub].to(DEVICE), 0.125, out=out,
                     q_lens=torch.tensor([4, 16], dtype=torch.int32, device=DEVICE))
    assert out[4].isnan().all()
    keep = torch.ones(21, dtype=torch.bool)
    keep[4] = False
    assert rel_err(out[keep].cpu(), ref[keep]) <= TOL


@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_return_lse(page_size: int) -> None:
    """fp32 output and natural log-sum-exp per query row, packed or as a `q_lens` subset."""
    p = page_size
    seqs = [(0, 1), (p, p + 1), (2 * p + 1, 3), (40, 19), (p - 1, 2)]
    kv_lens = [a + n for a, n in seqs]
    paged = Paged(kv_lens, page_size, 2, seed=p)
    q_start = torch.tensor([0] + [n for _, n in seqs]).cumsum(0).to(torch.int32)
    q = torch.randn(int(q_start[-1]), 6, HEAD_DIM, generator=torch.Generator().manual_seed(4))
    ref_o, ref_lse = reference.extend_attention(q, paged.k_clean, paged.v_clean,
                                                paged.ref_tables, q_start, paged.kv_lens,
                                                0.125, return_lse=True)
    tables, lens = paged.block_tables.to(DEVICE), paged.kv_lens.to(DEVICE)
    out, lse = nan_like(tuple(q.shape)), nan_like(tuple(q.shape[:2]))
    got = extend_attention(q.to(DEVICE), paged.k, paged.v, tables, q_start.to(DEVICE), lens,
                           0.125, out=out, lse_out=lse, return_lse=True)
    assert got[0] is out and got[1] is lse
    assert rel_err(out.cpu(), ref_o) <= TOL and rel_err(lse.cpu(), ref_lse) <= TOL
    # Sequences 1 and 3 only, addressed in place: the other rows stay unwritten.
    sub = torch.tensor([1, 3])
    out, lse = nan_like(tuple(q.shape)), nan_like(tuple(q.shape[:2]))
    extend_attention(q.to(DEVICE), paged.k, paged.v, tables[sub], q_start[sub].to(DEVICE),
                     lens[sub], 0.125, out=out, lse_out=lse, return_lse=True,
                     q_lens=(q_start[1:] - q_start[:-1])[sub].to(DEVICE))
    rows = torch.cat([torch.arange(int(q_start[b]), int(q_start[b + 1])) for b in sub])
    keep = torch.zeros(len(q), dtype=torch.bool)
    keep[rows] = True
    assert out[~keep].isnan().all() and lse[~keep].isnan().all()
    assert rel_err(out[keep].cpu(), ref_o[keep]) <= TOL
    assert rel_err(lse[keep].cpu(), ref_lse[keep]) <= TOL


# ---------------------------------------------------------------------------- cascade

class SharedRuns:
    """One random cascade level: run g has `run_rows[g]` query rows (distinct rows of q,
    in random order; q is a strided slice) and the whole blocks covering `run_tokens[g]`,
    with consecutive ids (read in place by the reference) when `contiguous[g]`, else
    scattered over the pool; blocks no run reads are NaN for the kernel."""

    def __init__(self, run_rows: list[int], run_tokens: list[int], contiguous: list[bool],
                 page_size: int, num_kv_heads: int, group: int, head_dim: int = 32,
                 seed: int = 0, dtype: torch.dtype = torch.float32):
        gen = torch.Generator().manual_seed(seed)
        need = [-(-n // page_size) for n in run_tokens]
        num_blocks = sum(need) + len(need) + 3
        shape = (num_blocks, page_size, num_kv_heads, head_dim)
        self.k_clean = torch.randn(shape, generator=gen).to(dtype)
        self.v_clean = torch.randn(shape, generator=gen).to(dtype)
        runs: list[list[int] | None] = []
        cursor = 0
        for n, contig in zip(need, contiguous):  # consecutive ids, a gap after each
            runs.append(list(range(cursor, cursor + n)) if contig else None)
            cursor += n + 1 if contig else 0
        used = {b for run in runs if run for b in run}
        free = [b for b in torch.randperm(num_blocks, generator=gen).tolist() if b not in used]
        runs = [run if run is not None else [free.pop() for _ in range(n)]
                for run, n in zip(runs, need)]
        self.block_offsets = [0] + torch.tensor(need).cumsum(0).tolist()
        self.blocks = torch.tensor([b for run in runs for b in run], dtype=torch.long)
        unread = torch.ones(num_blocks, dtype=torch.bool)
        unread[self.blocks] = False
        self.k = self.k_clean.masked_fill(unread[:, None, None, None], float("nan")).to(DEVICE)
        self.v = self.v_clean.masked_fill(unread[:, None, None, None], float("nan")).to(DEVICE)
        num_heads = num_kv_heads * group
        total = sum(run_rows)
        fused = torch.randn(total + 3, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
        self.q = fused.to(dtype)[:, :num_heads]
        self.rows = torch.randperm(total + 3, generator=gen)[:total]
        self.row_offsets = [0] + torch.tensor(run_rows).cumsum(0).tolist()

    def reference(self, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        return reference.cascade_level_attention(
            self.q.float(), self.k_clean.float(), self.v_clean.float(), self.rows,
            self.row_offsets, self.blocks, self.block_offsets, scale)

    def run(self, scale: float, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        return cascade_level_attention(
            self.q.to(DEVICE), self.k, self.v, self.rows.to(DEVICE), self.row_offsets,
            self.blocks.to(DEVICE), self.block_offsets, scale, **kwargs)


@pytest.fixture
def poisoned_cascade_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    poison_workspace(monkeypatch, cascade_mod)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-pass", "split-kv"])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("page_size", [1, 16])
def test_cascade_level_matches_reference(page_size: int, group: int, num_splits: int,
                                         poisoned_cascade_workspace: None) -> None:
    """Runs of 1..16 rows over 1 block, a few pages and ~9 tiles of tokens, consecutive
    and scattered blocks; with 3 splits the short runs' later splits are empty."""
    p = page_size
    level = SharedRuns(run_rows=[2, 16, 1, 5, 3], run_tokens=[p, 70, 33, 150, 2 * p],
                       contiguous=[True, False, True, True, False], page_size=p,
                       num_kv_heads=2, group=group, seed=p * 10 + group)
    ref_o, ref_lse = level.reference(0.17)
    offsets = run_offsets(level.row_offsets, level.block_offsets, DEVICE)
    shape = (len(level.rows), *level.q.shape[1:])
    out, lse = nan_like(shape), nan_like(shape[:2])
    got = level.run(0.17, num_splits=num_splits, offsets=offsets, out=out, lse_out=lse)
    assert got[0] is out and got[1] is lse
    assert rel_err(out.cpu(), ref_o) <= TOL and rel_err(lse.cpu(), ref_lse) <= TOL


@pytest.mark.parametrize("block_m", [32, 64])
@pytest.mark.parametrize("group", [3, 8])
def test_cascade_level_half_precision_row_tiles(group: int, block_m: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The 32- and 64-row tiles that half-precision inputs get (fp32 ones use 16), forced
    on fp32 so that they are checked to 1e-5."""
    monkeypatch.setattr(cascade_mod, "tile_rows", lambda packed, elem_size=2: block_m)
    level = SharedRuns(run_rows=[16, 1, 7], run_tokens=[70, 16, 150],
                       contiguous=[False, True, True], page_size=16, num_kv_heads=2,
                       group=group, seed=group + block_m)
    ref_o, ref_lse = level.reference(0.17)
    for splits in (1, 2):
        o, lse = level.run(0.17, num_splits=splits)
        assert rel_err(o.cpu(), ref_o) <= TOL and rel_err(lse.cpu(), ref_lse) <= TOL


def test_cascade_level_default_buffers_and_one_run() -> None:
    """One run, one row, one block (the smallest level), fresh outputs, the lists
    converted inside."""
    level = SharedRuns([1], [16], [True], 16, num_kv_heads=1, group=3)
    ref_o, ref_lse = level.reference(0.2)
    o, lse = level.run(0.2)
    assert o.dtype == lse.dtype == torch.float32
    assert rel_err(o.cpu(), ref_o) <= TOL and rel_err(lse.cpu(), ref_lse) <= TOL


def test_cascade_split_heuristic_path(poisoned_cascade_workspace: None) -> None:
    """Few programs over a long run split by default; many programs, or short runs, not."""
    assert cascade_mod.choose_num_splits(2, 600, num_sms=132) == 2
    assert cascade_mod.choose_num_splits(8 * 8, 1000, num_sms=132) == 3
    assert cascade_mod.choose_num_splits(300, 4096, num_sms=132) == 1
    assert cascade_mod.choose_num_splits(4, 300, num_sms=132) == 1
    level = SharedRuns([2, 3], [600, 48], [False, True], 16, num_kv_heads=1, group=2)
    ref_o, ref_lse = level.reference(0.1)
    o, lse = level.run(0.1)
    assert rel_err(o.cpu(), ref_o) <= TOL and rel_err(lse.cpu(), ref_lse) <= TOL


def test_cascade_level_head_dim_80() -> None:
    level = SharedRuns([3, 4], [40, 17], [True, False], 16, num_kv_heads=2, group=2,
                       head_dim=80)
    ref_o, ref_lse = level.reference(0.1)
    o, lse = level.run(0.1)
    assert rel_err(o.cpu(), ref_o) <= TOL and rel_err(lse.cpu(), ref_lse) <= TOL


class States:
    """Random attention states to merge: accumulators for `num_acc` rows, partials for
    the distinct rows `index`, with -inf log-sum-exps on either side (no keys)."""

    def __init__(self, num_acc: int, num_rows: int, num_heads: int, head_dim: int = 32,
                 seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.acc_o = torch.randn(num_acc, num_heads, head_dim, generator=gen)
        self.acc_lse = 4 * torch.randn(num_acc, num_heads, generator=gen)
        self.index = torch.randperm(num_acc, generator=gen)[:num_rows]
        self.o = torch.randn(num_rows, num_heads, head_dim, generator=gen)
        self.lse = 4 * torch.randn(num_rows, num_heads, generator=gen)
        self.lse[0, 1] = float("-inf")             # the partial has no keys
        self.acc_lse[self.index[1], 0] = float("-inf")  # the accumulator has none yet
        self.lse[2, :] = float("-inf")
        self.acc_lse[self.index[3], :] = float("-inf")
        self.lse[4, 2] = self.acc_lse[self.index[4], 2] + 30  # far apart: stays stable

    def merged(self, fn) -> tuple[torch.Tensor, torch.Tensor]:
        acc_o, acc_lse = self.acc_o.clone().to(DEVICE), self.acc_lse.clone().to(DEVICE)
        fn(acc_o, acc_lse, self.index.to(DEVICE), self.o.to(DEVICE), self.lse.to(DEVICE))
        return acc_o.cpu(), acc_lse.cpu()


@pytest.mark.parametrize("num_heads", [6, 20], ids=["one-head-tile", "two-head-tiles"])
def test_merge_states_matches_reference(num_heads: int) -> None:
    states = States(num_acc=23, num_rows=17, num_heads=num_heads, seed=num_heads)
    ref_o, ref_lse = states.merged(reference.merge_attention_states_)
    got_o, got_lse = states.merged(merge_attention_states_)
    assert rel_err(got_o, ref_o) <= TOL
    torch.testing.assert_close(got_lse, ref_lse, rtol=TOL, atol=TOL)
    untouched = torch.ones(23, dtype=torch.bool)
    untouched[states.index] = False
    assert torch.equal(got_o[untouched], states.acc_o[untouched])
    assert torch.equal(got_lse[untouched], states.acc_lse[untouched])
    # -inf on one side: the other side's state, exactly where its weight is exactly 1.
    assert torch.equal(got_o[states.index[2]], states.acc_o[states.index[2]])
    assert torch.equal(got_o[states.index[3]], states.o[3])
    assert torch.equal(got_lse[states.index[3]], states.lse[3])


def test_merge_states_ignores_the_empty_side() -> None:
    """A side with lse -inf is never read into the sum (its o may be garbage), and a row
    empty on both sides is left as it was."""
    states = States(num_acc=8, num_rows=5, num_heads=4, seed=1)
    states.o[2] = float("nan")
    states.acc_o[states.index[3]] = float("nan")
    states.lse[4, :] = float("-inf")
    states.acc_lse[states.index[4], :] = float("-inf")
    got_o, got_lse = states.merged(merge_attention_states_)
    assert torch.equal(got_o[states.index[2]], states.acc_o[states.index[2]])
    assert torch.equal(got_o[states.index[3]], states.o[3])
    both_empty = states.index[4]
    assert torch.equal(got_o[both_empty], states.acc_o[both_empty])
    assert got_lse[both_empty].eq(float("-inf")).all()
    assert torch.isfinite(got_o).all()


# ---------------------------------------------------------------------------- contiguous

class Views:
    """The virtual layout as the kernels see it: each sequence's blocks consecutive ids (a
    gap after each sequence), NaN where no sequence owns. `tables` (for the reference) list
    them; `first_only` repeats each row's first id, so a kernel that walked the table
    instead of counting from its first entry would read the wrong blocks."""

    def __init__(self, kv_lens: list[int], page_size: int, num_kv_heads: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        need = [-(-n // page_size) for n in kv_lens]
        starts = torch.tensor([0] + need[:-1]).cumsum(0) + torch.arange(len(need))
        width = max(need) + 2
        self.tables = (starts[:, None] + torch.arange(width)[None, :]).to(torch.int32)
        self.first_only = self.tables[:, :1].expand(-1, width).contiguous()
        shape = (int(starts[-1]) + width, page_size, num_kv_heads, HEAD_DIM)
        self.k_clean = torch.randn(shape, generator=gen)
        self.v_clean = torch.randn(shape, generator=gen)
        owned = torch.zeros(shape[:2], dtype=torch.bool)
        for start, n in zip(starts.tolist(), kv_lens):
            owned.view(-1)[start * page_size:][:n] = True
        self.k = self.k_clean.masked_fill(~owned[..., None, None], float("nan")).to(DEVICE)
        self.v = self.v_clean.masked_fill(~owned[..., None, None], float("nan")).to(DEVICE)
        self.kv_lens = torch.tensor(kv_lens, dtype=torch.int32)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-pass", "split-kv"])
@pytest.mark.parametrize("window", [None, 40])
def test_contiguous_decode(num_splits: int, window: int | None,
                           poisoned_workspace: None) -> None:
    views = Views([1, 16, 17, 150, 600], 16, 2)
    q = torch.randn(5, 6, HEAD_DIM)
    ref = reference.paged_decode_attention(q, views.k_clean, views.v_clean, views.tables,
                                           views.kv_lens, 0.125, window=window)
    out = paged_decode_attention(q.to(DEVICE), views.k, views.v, views.first_only.to(DEVICE),
                                 views.kv_lens.to(DEVICE), 0.125, num_splits=num_splits,
                                 window=window, contiguous=True)
    assert rel_err(out.cpu(), ref) <= TOL


@pytest.mark.parametrize("window", [None, 20])
def test_contiguous_extend(window: int | None) -> None:
    seqs = [(0, 9), (40, 1), (33, 70), (16, 16)]  # (cached, new)
    kv_lens = [c + n for c, n in seqs]
    views = Views(kv_lens, 16, 2)
    q_start = torch.tensor([0] + [n for _, n in seqs]).cumsum(0).to(torch.int32)
    q = torch.randn(int(q_start[-1]), 4, HEAD_DIM)
    ref = reference.extend_attention(q, views.k_clean, views.v_clean, views.tables, q_start,
                                     views.kv_lens, 0.125, window=window)
    out = extend_attention(q.to(DEVICE), views.k, views.v, views.first_only.to(DEVICE),
                           q_start.to(DEVICE), views.kv_lens.to(DEVICE), 0.125, window=window,
                           contiguous=True)
    assert rel_err(out.cpu(), ref) <= TOL


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-pass", "split-kv"])
def test_contiguous_cascade_level(num_splits: int, poisoned_cascade_workspace: None) -> None:
    """Runs of consecutive blocks, each named by its first block only."""
    level = SharedRuns(run_rows=[2, 16, 1], run_tokens=[16, 300, 48], contiguous=[True] * 3,
                       page_size=16, num_kv_heads=2, group=3, seed=7)
    ref_o, ref_lse = level.reference(0.17)
    firsts = torch.repeat_interleave(level.blocks[level.block_offsets[:-1]],
                                     torch.tensor(level.block_offsets).diff())
    o, lse = cascade_level_attention(
        level.q.to(DEVICE), level.k, level.v, level.rows.to(DEVICE), level.row_offsets,
        firsts.to(DEVICE), level.block_offsets, 0.17, num_splits=num_splits, contiguous=True)
    assert rel_err(o.cpu(), ref_o) <= TOL and rel_err(lse.cpu(), ref_lse) <= TOL


# ---------------------------------------------------------------------------- GPU compile

@pytest.mark.slow
def test_kernels_compile_for_hopper() -> None:
    """The interpreter accepts code the GPU compiler rejects: compile a few real launches
    for sm_90 ahead of time (no GPU needed; triton ships ptxas)."""
    import subprocess
    import sys
    from pathlib import Path

    try:
        from triton.backends.nvidia.compiler import get_ptxas
        if not os.path.exists(get_ptxas(90).path):
            pytest.skip("triton's ptxas is missing")
    except Exception:  # noqa: BLE001
        pytest.skip("triton has no NVIDIA backend here")
    script = Path(__file__).resolve().parent / "compile_check.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    res = subprocess.run([sys.executable, str(script), "--quick"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert " 0 failed" in res.stdout


# ---------------------------------------------------------------------------- half precision

def test_half_precision_paths(poisoned_workspace: None,
                              poisoned_cascade_workspace: None) -> None:
    """fp16 inputs (the interpreter cannot do bf16 dots: triton-lang/triton#11584, so bf16
    is checked on the GPU by tests/gpu/test_kernels_bf16.py): fp32 accumulation, half outputs."""
    half = torch.float16
    paged = Paged([1, 16, 17, 150], 16, 2)
    k, v = paged.k.to(half), paged.v.to(half)
    kc, vc = paged.k_clean.to(half).float(), paged.v_clean.to(half).float()
    tables = paged.block_tables.to(DEVICE)
    kv_lens = paged.kv_lens.to(DEVICE)
    q = torch.randn(4, 6, HEAD_DIM).to(half)
    ref = reference.paged_decode_attention(q.float(), kc, vc, paged.ref_tables, paged.kv_lens,
                                           0.125)
    for splits in (1, 2):
        out = paged_decode_attention(q.to(DEVICE), k, v, tables, kv_lens, 0.125,
                                     num_splits=splits)
        assert out.dtype == half and rel_err(out.cpu(), ref) <= 1e-2
    q_start = torch.tensor([0, 1, 9, 26, 66], dtype=torch.int32)
    qe = torch.randn(66, 6, HEAD_DIM).to(half)
    ref = reference.extend_attention(qe.float(), kc, vc, paged.ref_tables, q_start,
                                     paged.kv_lens, 0.125)
    out = extend_attention(qe.to(DEVICE), k, v, tables, q_start.to(DEVICE), kv_lens, 0.125)
    assert out.dtype == half and rel_err(out.cpu(), ref) <= 1e-2
    level = SharedRuns([3, 1], [40, 16], [False, True], 16, num_kv_heads=2, group=3,
                       dtype=half)
    ref_o, ref_lse = level.reference(0.125)
    for splits in (1, 2):
        o, lse = level.run(0.125, num_splits=splits)
        assert o.dtype == torch.float32 and rel_err(o.cpu(), ref_o) <= 1e-2
        assert rel_err(lse.cpu(), ref_lse) <= 1e-2
    new = torch.randn(3, 2, HEAD_DIM).to(half).to(DEVICE)
    store_kv(k, v, torch.tensor([0, 5, 9], device=DEVICE), new, new)
    assert torch.equal(k.view(-1, 2, HEAD_DIM)[5], new[1])
