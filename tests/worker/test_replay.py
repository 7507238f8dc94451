"""The worker-side state contract (`scheduler/worker_rows.py` -> `worker/seq_rows.py`):
the step messages a real Engine sends are all a worker needs. Replayed against a fresh
worker, they bring it to the same rows (block tables, penalty history) and sample the same
tokens, through chunked prefill, penalties, parallel samples (forks), retraction in a small
pool, overlap's placeholders, and a failed step, after which the reset makes the worker
forget every row it held.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

import radixserve.scheduler.overlap as overlap_module
from radixserve.config import EngineConfig
from radixserve.messages import ForwardBatch, ForwardResult
from radixserve.worker.cascade import CascadePlan
from radixserve.worker.seq_rows import SeqRows, StepSeqs
from radixserve.worker.worker import Worker
from tests.conftest import checked_engine
from tests.factories import tiny_model_dir

@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("replay"), num_layers=2, hidden_size=64,
                          tie_word_embeddings=False)


@dataclass
class Step:
    message: bytes
    """The step as it crossed to the worker, before the worker read it."""
    tokens: list[list[int]] | None = None
    """What it sampled, per sequence (its token, then forks' and drafts'); None: failed."""


def sampled(result: ForwardResult) -> list[list[int]]:
    return [[o.next_token, *o.fork_tokens, *o.spec_tokens] for o in result.outputs]


def state(rows: SeqRows) -> tuple[dict, dict, dict, dict]:
    """What the worker holds, by sequence id: tables, sampling parameters and output
    indices, and penalty history."""
    return (dict(rows.table.host), dict(rows.sampling.params), dict(rows.sampling.steps),
            dict(rows.penalties.history))


def record(tiny: Path, monkeypatch: pytest.MonkeyPatch, overlap: bool
           ) -> tuple[list[Step], tuple[dict, dict, dict, dict], EngineConfig]:
    """A workload on an Engine with a small pool, then a call whose first step the worker
    fails after applying its rows (as a step failing mid-way does), then one more: every
    step message, each with what it sampled, and what the worker holds at the end."""
    steps: list[Step] = []
    launched: list[Step] = []
    armed = [False]
    real_launch, real_collect = Worker.launch, Worker.collect
    real_plan = Worker._plan

    def launch(self: Worker, batch: ForwardBatch) -> None:
        steps.append(step := Step(msgspec.msgpack.encode(batch)))
        real_launch(self, batch)
        launched.append(step)

    def collect(self: Worker) -> ForwardResult:
        result = real_collect(self)
        launched.pop(0).tokens = sampled(result)
        return result

    def fail_once(self: Worker, step: StepSeqs) -> CascadePlan | None:
        if armed[0]:  # the rows are applied: the step fails mid-way
            armed[0] = False
            raise RuntimeError("injected worker failure")
        return real_plan(self, step)

    monkeypatch.setattr(Worker, "launch", launch)
    monkeypatch.setattr(Worker, "collect", collect)
    monkeypatch.setattr(Worker, "_plan", fail_once)
    if overlap:
        monkeypatch.setattr(overlap_module, "OVERLAP_DEVICES", frozenset({"cuda", "cpu"}))
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 3000) for _ in range(10 + 7 * i)] for i in range(6)]
    plain = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    with checked_engine(tiny, debug_invariants=True, max_total_tokens=128, page_size=4,
                        chunked_prefill_size=16, init_new_token_ratio=0.05,
                        min_new_token_ratio=0.0) as engine:
        assert (engine.scheduler.overlap is not None) == overlap
        engine.generate(input_ids=prompts, sampling_params=[
            plain, {**plain, "repetition_penalty": 1.5, "frequency_penalty": 0.3},
            {**plain, "temperature": 0.8, "seed": 3, "n": 2},
            {**plain, "presence_penalty": 0.5}, plain,
            {**plain, "temperature": 0.7, "top_k": 20, "seed": 5}])
        assert engine.stats()["retractions"] > 0
        armed[0] = True
        failed = engine.generate(input_ids=prompts[:2], sampling_params=plain)
        assert all(r["meta_info"]["finish_reason"]["type"] == "abort" for r in failed)
        engine.generate(input_ids=prompts[2:4], sampling_params=plain)
        worker, config = engine.worker, engine.config
    assert worker.rows.row_of, "the last step's rows are still held"
    return steps, state(worker.rows), config


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_fresh_worker_replays_the_steps(tiny, monkeypatch, overlap) -> None:
    steps, held, config = record(tiny, monkeypatch, overlap)
    monkeypatch.undo()  # the fresh worker runs unpatched
    (failed,) = [i for i, s in enumerate(steps) if s.tokens is None]
    fresh = Worker(config, tiny)
    forks = placeholders = penalized = 0
    for i, step in enumerate(steps):
        batch = msgspec.msgpack.decode(step.message, type=ForwardBatch)
        forks += sum(len(s.fork_seeds) for s in batch.sample_steps)
        placeholders += len(batch.placeholders)
        penalized += len(batch.penalized)
        if i == failed:  # its rows were applied before it failed
            fresh.rows.apply(batch)
            before = set(fresh.rows.row_of)
            continue
        assert sampled(fresh.forward(batch)) == step.tokens, f"step {i}"
        if i == failed + 1:  # the reset: the worker holds only this step's rows
            assert batch.reset_rows
            placed = {e.seq for e in batch.table_edits}
            assert set(fresh.rows.row_of) == placed == set(batch.seqs)
            assert set(fresh.rows.table.host) == placed
            assert set(fresh.rows.penalties.history) <= placed
            assert set(fresh.rows.sampling.params) <= placed
            assert before - placed, "rows held before the reset are gone"
    assert state(fresh.rows) == held
    assert forks > 0 and penalized > 0 and (placeholders > 0) == overlap
