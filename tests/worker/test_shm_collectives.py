"""The tensor-parallel group's collectives between real processes: the shared-memory sum
equals the ranks' partials added in rank order, bit for bit on every rank, call after call
(the two slot sets alternating), and gathers between the sums are every rank's tensor in
rank order; a tensor too large for a slot goes through gloo; nothing is left in /dev/shm;
and a rank that dies fails the others' call instead of hanging it."""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
import pytest
import torch

from radixserve.worker import shm_collectives
from radixserve.worker.tensor_parallel import Placement, TPGroup, rendezvous

pytestmark = pytest.mark.skipif(not shm_collectives.available(), reason="x86 and /dev/shm")
WORLD = 3
SHAPES = [(1, 64), (5, 576), (64, 576), (3, 1 + shm_collectives.SLOT_BYTES // 4)]
"""Decode and prefill sized partials, and one past a slot (gloo's)."""


def partial(rank: int, call: int, shape: tuple[int, int]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * call + rank))


def rank_main(rank: int, meet: str, results, die: bool) -> None:
    torch.set_num_threads(1)
    group = TPGroup(Placement(rank, WORLD, WORLD), meet, shm=True)
    if die and rank == WORLD - 1:
        os._exit(0)
    try:
        out, gathered = [], []
        for call, shape in enumerate(SHAPES * 2):
            out.append(group.all_reduce(partial(rank, call, shape)).numpy())
            if call % 2:  # gathers between sums: the slot sets alternate across both
                g = group.gather_columns(partial(rank, call, shape) * 2)
                gathered.append(None if g is None else g.numpy())
        results.put((rank, out, gathered, None))  # numpy: by value, not shared memory
    except RuntimeError as e:
        results.put((rank, None, None, str(e)))
    group.close()


def run(die: bool = False) -> dict[int, tuple]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    before = set(os.listdir("/dev/shm"))
    with tempfile.TemporaryDirectory() as private:
        meet = rendezvous(None, private)
        procs = [ctx.Process(target=rank_main, args=(r, meet, results, die))
                 for r in range(WORLD)]
        for p in procs:
            p.start()
        want = WORLD - 1 if die else WORLD
        out = {}
        while len(out) < want:
            rank, sums, gathered, error = results.get(timeout=120)
            out[rank] = (sums, gathered, error)
        for p in procs:
            p.join(30)
    assert not {f for f in set(os.listdir("/dev/shm")) - before if "radixserve" in f}
    return out


def test_sums_are_the_rank_order_sum_on_every_rank():
    out = run()
    for call, shape in enumerate(SHAPES * 2):
        want = partial(0, call, shape)
        for r in range(1, WORLD):
            want = want + partial(r, call, shape)
        first = torch.from_numpy(out[0][0][call])
        for rank in range(WORLD):
            got = torch.from_numpy(out[rank][0][call])
            assert torch.equal(got, first), (rank, call)  # every rank the same bits
        if shape != SHAPES[-1]:  # shared memory: the rank-order sum exactly
            assert torch.equal(first, want), call
        else:
            torch.testing.assert_close(first, want)
    for k, call in enumerate(range(1, 2 * len(SHAPES), 2)):
        shape = (SHAPES * 2)[call]
        want = torch.cat([partial(r, call, shape) * 2 for r in range(WORLD)], dim=1)
        assert torch.equal(torch.from_numpy(out[0][1][k]), want), call
        assert all(out[r][1][k] is None for r in range(1, WORLD))


def test_a_dead_rank_fails_the_call():
    start = time.monotonic()
    out = run(die=True)
    assert all(error is not None for _, _, error in out.values()), out
    assert time.monotonic() - start < 60
