"""Tree attention's cost model (`worker/cascade_cost.py`): its verdict on plans from given
costs, the bounds that hold a measurement, and a measurement's shape (no timing is
asserted: what a machine measures is its load's as much as the kernel's)."""

from __future__ import annotations

import dataclasses
import itertools
import math

import torch

from radixserve.worker.attention.torch_backend import TorchAttentionBackend
from radixserve.worker.cascade import CascadePlan, SharedRun
from radixserve.worker.cascade_cost import BOUNDS, MARGIN, CascadeCost

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


def test_a_plan_that_does_not_beat_the_graph_replay_is_dropped() -> None:
    plan, rows = one_run(64, 63), [1] * 64
    assert COST.pays(plan, rows, 16) and COST.pays(plan, rows, 16, graphed=True)
    replay = dataclasses.replace(COST, graph_step=1.0)  # a replay saving a second a step
    assert replay.pays(plan, rows, 16) and not replay.pays(plan, rows, 16, graphed=True)


def _corners() -> list[CascadeCost]:
    """The cost model at every corner of `BOUNDS` (plain_key 1 ns)."""
    key = 1e-9
    return [CascadeCost(key, *(key * v for v in values), num_layers=30)
            for values in itertools.product(*((low, high) for _, low, high in (
                BOUNDS[n] for n in ("shared_key", "per_level", "per_row", "per_step"))))]


def test_the_bounds_hold_a_measurement_and_no_corner_flips_the_verdict() -> None:
    # The measurement a loaded machine made (shared 1.03e-6 s a key against plain
    # 1.40e-7 s): held to the bounds' highest share, not a veto for the process's life.
    loaded = CascadeCost(1.40e-7, 1.03e-6, 1e-3, 1e-4, 1.0, 30).bounded()
    assert loaded.shared_key == BOUNDS["shared_key"][2] * 1.40e-7
    assert loaded.per_level == BOUNDS["per_level"][2] * 1.40e-7
    assert loaded.per_step == BOUNDS["per_step"][2] * 1.40e-7
    assert loaded.pays(one_run(64, 63), [1] * 64, 16)
    quiet = CascadeCost(1.40e-7, 0.0, 0.0, 0.0, 0.0, 30).bounded()
    assert quiet.shared_key == BOUNDS["shared_key"][1] * 1.40e-7 and quiet.per_row > 0
    # Within the bounds the costs stand as measured; no time at all gives the defaults.
    assert COST.bounded() == COST
    assert CascadeCost(0.0, 1e-6, 0.0, 0.0, 0.0, 30).bounded() == CascadeCost.default(30)
    for cost in _corners():
        assert cost.pays(one_run(64, 63), [1] * 64, 16), cost  # the bench's headline
        assert not cost.pays(one_run(64, 1), [1] * 64, 16), cost  # a block
        assert not cost.pays(one_run(4, 2), [1] * 4, 16), cost


def test_measured_through_the_torch_backend_is_bounded() -> None:
    # Only the measurement's shape: which path is faster is the machine's to say.
    cache = torch.zeros(1, 16, 3, 64)  # the default model's KV heads and head_dim
    cost = CascadeCost.measure(TorchAttentionBackend(), 9, cache, num_layers=30,
                               repeats=1, rounds=1)
    values = [cost.plain_key, cost.shared_key, cost.per_level, cost.per_row, cost.per_step]
    assert all(math.isfinite(v) and v >= 0 for v in values), cost
    assert cost.plain_key > 0 and cost.num_layers == 30 and cost.graph_step == 0.0
    assert cost.bounded() == cost
