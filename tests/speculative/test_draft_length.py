"""How long a sequence's draft is: its recent acceptance, and what a draft row costs in the
step (StepCost fitted to timed steps)."""

import random

import pytest

from radixserve.speculative.seq_drafts import PROBE_EVERY, SeqDrafts
from radixserve.speculative.step_cost import StepCost


def fitted(fixed: float, per_token: float, sizes: list[int], noise: float = 0.0) -> StepCost:
    cost, rng = StepCost(), random.Random(0)
    for n in sizes * 10:
        cost.observe(n, (fixed + per_token * n) * (1 + rng.uniform(-noise, noise)))
    return cost


def test_the_fit_recovers_fixed_and_per_token_costs_from_varied_steps() -> None:
    cost = fitted(0.06, 0.0026, [64, 96, 200, 320, 70], noise=0.02)
    assert cost.fixed == pytest.approx(0.06, rel=0.25)
    assert cost.per_token == pytest.approx(0.0026, rel=0.1)


def test_break_even_is_low_at_batch_1_and_high_when_compute_bound() -> None:
    cost = fitted(0.057, 0.0026, [1, 5, 8, 40, 64, 320])
    assert cost.break_even(1) < 0.05
    assert 0.2 < cost.break_even(8) < 0.3
    assert cost.break_even(64) > 0.7


def test_nothing_is_known_until_the_steps_differ() -> None:
    cost = StepCost()
    for _ in range(100):
        cost.observe(64, 0.2)  # a steady batch that never drafts: no slope to see
    assert cost.break_even(64) == 0.0
    varied = fitted(0.05, 0.001, [8, 40])
    before = varied.break_even(8)
    for _ in range(500):
        varied.observe(8, 0.058)  # the last identified fit stands
    assert varied.break_even(8) == pytest.approx(before)


def test_a_sequence_drafts_its_acceptance_share_while_drafts_are_free() -> None:
    assert SeqDrafts("lookup", 1.0).limit(4, 0.0) == 4
    d = SeqDrafts("lookup", 0.5)
    assert d.limit(4, 0.0) == 2
    assert d.limit(4, 0.05) == 2


def test_a_compute_bound_step_takes_only_drafts_likely_kept() -> None:
    assert SeqDrafts("lookup", 0.4).limit(4, 0.75) == 0
    assert SeqDrafts("lookup", 0.8).limit(4, 0.75) == 1  # 0.8 > 0.75 > 0.64
    assert SeqDrafts("lookup", 0.95).limit(4, 0.75) == 4
    assert SeqDrafts("lookup", 1.0).limit(4, 0.99) == 4  # never rejected: every row pays


def test_an_idle_sequence_probes_only_where_a_probe_is_cheap() -> None:
    d = SeqDrafts("lookup", 0.05, idle=PROBE_EVERY)
    assert d.limit(4, 0.04) == 1
    assert d.limit(4, 0.75) == 0
    assert d.limit(0, 0.0) == 0
