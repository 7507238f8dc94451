"""Off means free (issue 42): an Engine run with the defaults on one rank calls no drafter,
no step-cost fit, no mapping account (the paged layout maps nothing), no collective,
nothing of overlap scheduling (off on the CPU), of LoRA or of penalties (their pieces of
the worker's rows, scheduler/worker_rows.py), and plans no tree attention (nor measures
its costs) for a batch without a shared prefix; the same run over a shared prefix long
enough for the default gates does plan it (the count is live, not a dead path). Greedy
output equals transformers in both."""

from __future__ import annotations

import random
from collections import Counter

import pytest

import radixserve.worker.worker as worker_module
from radixserve.config import EngineConfig
from radixserve.scheduler.mappings import MappingAccount
from radixserve.scheduler.overlap import Pipeline, RunAhead
from radixserve.scheduler.worker_rows import AdapterSlot, KeptToken, PenaltyTokens
from radixserve.speculative.drafter import Drafter
from radixserve.speculative.step_cost import StepCost
from radixserve.worker.cascade_cost import CascadeCost
from radixserve.worker.seq_rows import StepSeqs
from radixserve.worker.tensor_parallel import TPGroup
from tests.conftest import ENGINE_TEST_DEFAULTS, checked_engine
from tests.factories import tiny_model_dir
from tests.hf_reference import HFReference, assert_matches_reference

COUNTED = [(Drafter, "propose"), (StepCost, "observe"),
           (MappingAccount, "__init__"), (MappingAccount, "fits"), (MappingAccount, "admits"),
           (MappingAccount, "grows"),
           (TPGroup, "share"), (TPGroup, "failing"), (TPGroup, "all_reduce"),
           (TPGroup, "gather_columns"), (TPGroup, "any_of"), (TPGroup, "all_min"),
           (worker_module, "plan_cascade"), (CascadeCost, "measure"), (RunAhead, "__init__"),
           (Pipeline, "__init__"), (StepSeqs, "keep_tokens"), (KeptToken, "account"),
           (AdapterSlot, "account"), (PenaltyTokens, "account")]
"""What a step with nothing to do for a feature must not call."""

MAX_NEW = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("off"), num_layers=2, hidden_size=64)


@pytest.fixture
def calls(monkeypatch) -> Counter[str]:
    """How often each of `COUNTED` ran while the test ran."""
    seen: Counter[str] = Counter()
    for owner, name in COUNTED:
        real = getattr(owner, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            seen[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)
    return seen


def _run(tiny, prompts: list[list[int]], **config) -> dict:
    """Greedy `prompts` on an Engine with the defaults (but `config`), checked against
    transformers; returns the engine's stats."""
    with checked_engine(tiny, **ENGINE_TEST_DEFAULTS, **config) as engine:
        results = engine.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True})
        stats = engine.stats()
    hf = HFReference(tiny)
    for i, (ids, res) in enumerate(zip(prompts, results)):
        assert_matches_reference(res["output_ids"], hf.greedy(ids, MAX_NEW), f"prompt {i}")
    return stats


def test_defaults_call_nothing_that_is_off(tiny, calls):
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 5000) for _ in range(24 + 7 * i)] for i in range(5)]
    stats = _run(tiny, prompts)
    assert stats["cascade_steps"] == 0, stats
    assert sum(calls.values()) == 0, calls


def test_a_shared_prefix_is_planned_with_the_defaults(tiny, calls):
    defaults = EngineConfig(model=str(tiny))
    rng = random.Random(1)
    prefix = [rng.randrange(100, 5000) for _ in range(defaults.cascade_min_shared_tokens + 40)]
    prompts = [prefix + [rng.randrange(100, 5000) for _ in range(5 + i)]
               for i in range(defaults.cascade_min_group_size)]
    # The default gates alone deciding: on this tiny model the cost model rightly keeps
    # the plain path (a pass costs more than reading 552 tokens four times).
    stats = _run(tiny, prompts, cascade_cost_model=False)
    assert calls["plan_cascade"] > 0 and stats["cascade_steps"] > 0, (calls, stats)
    # Still nothing of what stays off: no drafts, fit, mappings or collectives.
    assert sum(calls.values()) == calls["plan_cascade"], calls
