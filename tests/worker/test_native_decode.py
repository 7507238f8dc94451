"""The native decode attention (`radixserve.native.decode_attention`) against plain
softmax attention over each sequence's keys: paged blocks and the virtual layout's
strided ones, grouped heads, keys from a start (a window or an own part), one key, many
chunks, and no keys at all; key sets read by many rows (tree attention's shared runs, the
lane kernel), for group sizes either side of its 16 lanes; rows reading several sets,
merged (a row's own part and its runs); and a step's extends as the torch backend reads
them (in causal blocks) against SDPA."""

from __future__ import annotations

import pytest
import torch

import radixserve.native as native
from radixserve.worker.attention import paged_torch
from radixserve.worker.attention.torch_backend import TorchAttentionBackend
from tests.factories import TreeStep

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


def test_a_row_reading_several_sets_attends_to_all_their_keys() -> None:
    # Rows 0-4 read an own part each; a run of 320 keys is read by rows 0-2 and one of 160
    # by rows 3, 4 and 0 (two levels for row 0); row 5 reads nothing.
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = (torch.randn(48, 16, 3, 64, generator=gen) for _ in range(2))
    blocks = torch.randperm(48, generator=gen)
    sets = [(blocks[0:3], 0, 40, [0]), (blocks[3:5], 3, 30, [1]), (blocks[5:7], 0, 17, [2]),
            (blocks[7:9], 0, 20, [3]), (blocks[9:10], 0, 5, [4]),
            (blocks[10:30], 0, 320, [0, 1, 2]), (blocks[30:40], 0, 160, [3, 4, 0])]
    tables = torch.zeros(len(sets), 20, dtype=torch.int32)
    for b, (table, *_) in enumerate(sets):
        tables[b, :len(table)] = table
    row_offsets = torch.tensor([0] + [len(rows) for *_, rows in sets]).cumsum(0)
    rows = torch.tensor([r for *_, set_rows in sets for r in set_rows])
    q = torch.randn(6, 9, 64, generator=gen)
    out, lse = native.decode_attention(q, k_cache, v_cache, tables,
                                       torch.tensor([s[1] for s in sets]),
                                       torch.tensor([s[2] for s in sets]), 0.125,
                                       row_offsets, rows)
    for r in range(5):  # the union of its sets' keys as one block of one set
        keys = [[cache[table.long()].flatten(0, 1)[start:n] for cache in (k_cache, v_cache)]
                for table, start, n, set_rows in sets if r in set_rows]
        k, v = (torch.cat(part)[None] for part in zip(*keys))
        want_out, want_lse = reference(q[r:r + 1], k, v, torch.zeros(1, 1, dtype=torch.int32),
                                       [0], [k.shape[1]], 0.125)
        torch.testing.assert_close(out[r:r + 1], want_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[r:r + 1], want_lse, rtol=1e-5, atol=1e-5)
    assert bool((out[5] == 0).all()) and bool(torch.isneginf(lse[5]).all())


@pytest.mark.parametrize("seqs, window", [
    ([(0, 40)], None),  # a prompt: two blocks of 16 rows and a part block
    ([(100, 33), (5, 1), (0, 16), (16, 17), (3, 2)], None),  # beside a decode, across edges
    ([(300, 5), (64, 1), (7, 9)], 8),  # a sliding window: each row a set of its own
])
def test_extends_read_in_causal_blocks_equal_sdpa(seqs, window) -> None:
    """A step's extends as the torch backend reads them in place (`_causal_sets`: a block's
    earlier keys one set for its rows, each row's own keys another) against SDPA over the
    gathered blocks (`paged_torch.extend_attention`), with NaN in every block slot past a
    context (a read of it would show)."""
    page, heads = 16, 9
    gen = torch.Generator().manual_seed(len(seqs))
    widths = [-(-(p + n) // page) for p, n in seqs]
    blocks = torch.randperm(sum(widths), generator=gen).tolist()
    step = TreeStep([blocks[sum(widths[:b]):sum(widths[:b + 1])] for b in range(len(seqs))],
                    [p + n for p, n in seqs], [n for _, n in seqs], page, num_kv_heads=3,
                    head_dim=64)
    k_cache, v_cache = step.caches(heads, seed=len(seqs))
    for table, kv in zip(step.block_tables, step.kv_lens):
        for cache in (k_cache, v_cache):
            cache[table[(kv - 1) // page], (kv - 1) % page + 1:] = float("nan")
    meta = step.metadata()
    q, k, v = (torch.randn(len(step.slots), n, 64, generator=gen) for n in (heads, 3, 3))
    backend = TorchAttentionBackend()
    backend.begin_forward(meta)
    got = backend.forward(q, k, v, k_cache, v_cache, 64 ** -0.5, window=window)
    want = paged_torch.extend_attention(q, k_cache, v_cache, meta.block_tables, meta.q_start,
                                        meta.kv_lens, 64 ** -0.5, window=window)
    assert not want.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
