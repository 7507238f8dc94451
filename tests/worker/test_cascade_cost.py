"""Tree attention's cost model (`worker/cascade_cost.py`): its verdict on plans from given
costs, and costs measured through the torch backend."""

from __future__ import annotations

import math

import torch

import radixserve.native as native
from radixserve.worker.attention.torch_backend import TorchAttentionBackend
from radixserve.worker.cascade import CascadePlan, SharedRun
from radixserve.worker.cascade_cost import MARGIN, CascadeCost

COST = CascadeCost(plain_key=52e-9, shared_key=36e-9, per_level=15e-6, per_row=1e-6,
                   per_step=250e-6, num_layers=30)
"""About what the default model's shapes measure on a 2-core EPYC."""


def one_run(rows: int, blocks: int) -> CascadePlan:
    return CascadePlan([[SharedRun(list(range(rows)), 0, list(range(blocks)))]],
                       [blocks * 16] * rows)


def test_long_runs_read_by_many_pay_and_short_or_lone_ones_do_not() -> None:
    assert COST.pays(one_run(64, 63), [1] * 64, 16)  # the bench's 64 x 1k
    assert COST.pays(one_run(32, 63), [1] * 32, 16)
    assert not COST.pays(one_run(4, 8), [1] * 4, 16)  # 128 tokens: the pass costs more
    assert not COST.pays(one_run(64, 1), [1] * 64, 16)
    # Extend rows count as rows: four prefill chunks of 16 tokens pay where four decodes
    # do not.
    assert not COST.pays(one_run(4, 16), [1] * 4, 16)
    assert COST.pays(one_run(4, 16), [16] * 4, 16)


def test_the_verdict_is_the_model_less_its_margin() -> None:
    rows, blocks = 8, 20
    pairs = rows * blocks * 16
    cascade = (COST.shared_key * pairs + COST.per_level + COST.per_row * rows
               + COST.per_step / COST.num_layers)
    plain = COST.plain_key * pairs
    assert COST.pays(one_run(rows, blocks), [1] * rows, 16) == (cascade <= (1 - MARGIN) * plain)
    # Where the shared pass costs a row as much as its own read, nothing pays.
    flat = CascadeCost(50e-9, 50e-9, 0.0, 0.0, 0.0, 30)
    assert not flat.pays(one_run(64, 1000), [1] * 64, 16)


def test_two_levels_pay_for_both_passes() -> None:
    # A second level adds its fixed work: a deep tree of tiny runs costs more than one run.
    root = SharedRun(list(range(8)), 0, list(range(60)))
    leaves = [SharedRun([0, 1, 2, 3], 60, [60]), SharedRun([4, 5, 6, 7], 60, [61])]
    one = CascadePlan([[root]], [960] * 8)
    two = CascadePlan([[root], leaves], [976] * 8)
    cost = CascadeCost(50e-9, 35e-9, 40e-6, 2e-6, 0.0, 30)
    assert cost.pays(one, [1] * 8, 16) and not cost.pays(two, [1] * 8, 16)


def test_measured_through_the_torch_backend() -> None:
    cache = torch.zeros(1, 16, 3, 64)  # the default model's KV heads and head_dim
    cost = CascadeCost.measure(TorchAttentionBackend(), 9, cache, num_layers=30,
                               repeats=1)
    values = [cost.plain_key, cost.shared_key, cost.per_level, cost.per_row, cost.per_step]
    assert all(math.isfinite(v) and v >= 0 for v in values), cost
    assert cost.plain_key > 0 and cost.num_layers == 30
    if native.available():
        # The lane kernel: a row's share of a run's key costs less than reading it alone
        # (timed in one thread's CPU time, which the machine's other work does not move).
        assert cost.shared_key < cost.plain_key, cost
