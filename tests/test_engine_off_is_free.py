"""Off means free (issues 42, 51): an Engine run with the defaults on one rank holds no
optional feature's hooks in its scheduler (scheduler/features.py) and never imports their
modules, calls no drafter, no step-cost fit, no mapping account (the paged layout maps
nothing), no collective, nothing of overlap scheduling (off on the CPU), of LoRA or of
penalties (their pieces of the worker's rows, scheduler/worker_rows.py), and plans no tree
attention (nor measures its costs) for a batch without a shared prefix; the same run over a
shared prefix long enough for the default gates does plan it (the count is live, not a dead
path), and a feature a request asks for turns on for it. Greedy output equals transformers."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import radixserve.worker.worker as worker_module
from radixserve.config import EngineConfig
from radixserve.scheduler.mappings import MappingAccount
from radixserve.scheduler.cache_steps import DiskSteps, PinSteps
from radixserve.scheduler.constraints import ConstraintWaits
from radixserve.scheduler.loras import LoraRegistry
from radixserve.scheduler.overlap import Pipeline, RunAhead
from radixserve.scheduler.shares import TenantShares
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
           (worker_module, "plan_cascade"), (CascadeCost, "pays"), (RunAhead, "__init__"),
           (Pipeline, "__init__"), (StepSeqs, "keep_tokens"), (KeptToken, "account"),
           (AdapterSlot, "account"), (PenaltyTokens, "account"), (LoraRegistry, "bind"),
           (TenantShares, "preempt"), (PinSteps, "__init__"), (DiskSteps, "__init__"),
           (ConstraintWaits, "start_step"), (worker_module.Worker, "_disk_transfers"),
           (worker_module.Worker, "_on_every_rank")]
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


FEATURE_MODULES = ("radixserve.scheduler.speculation", "radixserve.scheduler.cache_steps",
                   "radixserve.speculative.drafter")
"""Modules of optional features that a step with the feature off has no use for."""

SERVE_ONCE = """
import json, sys
from radixserve import Engine
from radixserve.scheduler.features import HOOKS
from tests.conftest import assert_blocks_accounted
with Engine(model=sys.argv[1], **json.loads(sys.argv[2])) as engine:
    engine.generate(input_ids=[[5, 6, 7, 8]], sampling_params={"max_new_tokens": 3})
    hooks = {h: len(getattr(engine.scheduler.hooks, h)) for h in HOOKS}
    assert_blocks_accounted(engine)
print(json.dumps({"hooks": hooks, "modules": sorted(sys.modules)}))
"""
"""One request served by a fresh process with the defaults: the hooks it holds (by name, how
many) and every module it imported."""


def test_features_off_hold_no_hooks_and_import_nothing(tiny):
    run = subprocess.run([sys.executable, "-c", SERVE_ONCE, str(tiny),
                          json.dumps(ENGINE_TEST_DEFAULTS)],
                         capture_output=True, text=True, check=True, timeout=300,
                         cwd=Path(__file__).resolve().parent.parent)
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert not any(seen["hooks"].values()), seen["hooks"]
    assert not set(FEATURE_MODULES) & set(seen["modules"]), set(FEATURE_MODULES) & set(
        seen["modules"])


def test_a_feature_a_request_asks_for_turns_on(tiny):
    rng = random.Random(2)
    prompts = [[rng.randrange(100, 5000) for _ in range(20)] for _ in range(3)]
    with checked_engine(tiny, **ENGINE_TEST_DEFAULTS) as engine:
        engine.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 2})
        assert engine.scheduler.spec is None
        engine.generate(input_ids=prompts[1:], sampling_params={
            "max_new_tokens": 4, "speculative": "lookup"})
        assert engine.scheduler.spec is not None
