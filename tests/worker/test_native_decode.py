"""The native decode attention (`radixserve.native.decode_attention`) against plain
softmax attention over each sequence's keys: paged blocks and the virtual layout's
strided ones, grouped heads, keys from a start (a window or an own part), one key, many
chunks, and no keys at all; and key sets read by many rows (tree attention's shared runs,
the lane kernel), for group sizes either side of its 16 lanes."""

from __future__ import annotations

import pytest
import torch

import radixserve.native as native

pytestmark = pytest.mark.skipif(not native.available(), reason="the CPU kernels do not build here")


def reference(q, k_cache, v_cache, tables, starts, lens, scale, row_offsets=None):
    """Softmax attention in fp64 of each row over its set's keys (row b over set b, or
    with `row_offsets` the rows of each set)."""
    rows = row_offsets.tolist() if row_offsets is not None else list(range(len(tables) + 1))
    outs, lses = [], []
    for b in range(len(tables)):
        k = k_cache[tables[b].long()].flatten(0, 1)[starts[b]:lens[b]]
        v = v_cache[tables[b].long()].flatten(0, 1)[starts[b]:lens[b]]
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        for r in range(rows[b], rows[b + 1]):
            scores = torch.einsum("hd,thd->ht", q[r].double(), k.double()) * scale
            outs.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v.double()))
            lses.append(scores.logsumexp(-1))
    return torch.stack(outs).float(), torch.stack(lses).float()


@pytest.mark.parametrize("heads,kv_heads,head_dim,page", [(9, 3, 64, 16), (8, 2, 128, 8),
                                                           (4, 4, 80, 1), (6, 1, 16, 32)])
@pytest.mark.parametrize("layout", ["paged", "layer-in-block", "token-major"])
def test_equals_softmax_attention(heads, kv_heads, head_dim, page, layout) -> None:
    gen = torch.Generator().manual_seed(heads * head_dim + page)
    lens, starts = [1, 37, 700, 2 * page], [0, 5, 300, 2 * page - 1]
    blocks = 8 + sum(-(-n // page) for n in lens)
    shape = {"paged": (blocks, page, kv_heads, head_dim),
             "layer-in-block": (blocks, 3, 2, page, kv_heads, head_dim),
             "token-major": (blocks, page, 3, 2, kv_heads, head_dim)}[layout]
    pool = torch.randn(shape, generator=gen)
    if layout == "paged":
        k_cache, v_cache = pool, torch.randn(shape, generator=gen)
    elif layout == "layer-in-block":
        k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    else:
        k_cache, v_cache = pool[:, :, 1, 0], pool[:, :, 1, 1]
    width = max(-(-n // page) for n in lens)
    tables = torch.stack([torch.randperm(blocks, generator=gen)[:width] for _ in lens]).int()
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    args = (tables, torch.tensor(starts), torch.tensor(lens), head_dim ** -0.5)
    out, lse = native.decode_attention(q, k_cache, v_cache, *args)
    want_out, want_lse = reference(q, k_cache, v_cache, *args)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_a_sequence_without_keys_has_zero_output_and_minus_infinite_lse() -> None:
    cache = torch.randn(4, 16, 2, 64)
    out, lse = native.decode_attention(torch.randn(2, 4, 64), cache, cache,
                                       torch.zeros(2, 1, dtype=torch.int32),
                                       torch.tensor([0, 3]), torch.tensor([5, 3]), 0.125)
    assert bool((out[1] == 0).all()) and bool(torch.isneginf(lse[1]).all())
    assert bool(torch.isfinite(lse[0]).all())


def test_keys_outside_the_table_are_refused() -> None:
    cache = torch.randn(4, 16, 2, 64)
    with pytest.raises(RuntimeError, match="outside its table"):
        native.decode_attention(torch.randn(1, 4, 64), cache, cache,
                                torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0]),
                                torch.tensor([33]), 0.125)


@pytest.mark.parametrize("heads,kv_heads,head_dim,page", [(9, 3, 64, 16), (32, 8, 128, 16),
                                                           (4, 4, 80, 1), (6, 1, 16, 32)])
@pytest.mark.parametrize("rows", [(2, 3), (4, 8), (16, 1, 5), (33, 64)], ids=str)
def test_shared_runs_read_once_for_their_rows(heads, kv_heads, head_dim, page, rows) -> None:
    # Sets of whole blocks read by several rows each: up to 64 rows x the group's query
    # heads per kv head (many lane blocks, part-filled ones, the dot kernel below 8), runs
    # of one key to several chunks, in blocks among NaN-poisoned ones never read.
    gen = torch.Generator().manual_seed(heads + head_dim + page + sum(rows))
    lens = [(1, 37, 700, 2 * page)[i % 4] for i in range(len(rows))]
    need = [-(-n // page) for n in lens]
    k_cache = torch.full((2 * sum(need), page, kv_heads, head_dim), float("nan"))
    v_cache = k_cache.clone()
    used = torch.randperm(len(k_cache), generator=gen)[:sum(need)]
    k_cache[used] = torch.randn(len(used), page, kv_heads, head_dim, generator=gen)
    v_cache[used] = torch.randn(len(used), page, kv_heads, head_dim, generator=gen)
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    for b, blocks in enumerate(used.split(need)):
        tables[b, :len(blocks)] = blocks
    row_offsets = torch.tensor([0, *rows]).cumsum(0)
    q = torch.randn(int(row_offsets[-1]), heads, head_dim, generator=gen)
    args = (tables, torch.zeros(len(lens), dtype=torch.long), torch.tensor(lens),
            head_dim ** -0.5)
    out, lse = native.decode_attention(q, k_cache, v_cache, *args, row_offsets)
    want_out, want_lse = reference(q, k_cache, v_cache, *args, row_offsets)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_row_offsets_must_span_the_rows() -> None:
    cache = torch.randn(4, 16, 2, 64)
    with pytest.raises(RuntimeError, match="span"):
        native.decode_attention(torch.randn(3, 4, 64), cache, cache,
                                torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0]),
                                torch.tensor([16]), 0.125, torch.tensor([0, 2]))
