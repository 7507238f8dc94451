"""Grammars compile off the scheduler's loop (issue 25, class 4): `add_request` returns at
once for a constraint not yet compiled, the other requests are scheduled while it compiles,
a compile past `max_grammar_compile_seconds` fails only its request, and a saturated
compiler refuses (overloaded) instead of piling up threads."""

from __future__ import annotations

import threading
import time

import pytest

from radixserve.config import EngineConfig
from radixserve.messages import SamplingParams, TokenizedRequest, WorkerInfo
from radixserve.scheduler.grammar_compiler import GrammarCompiler
from radixserve.scheduler.scheduler import OverloadedError, Scheduler
from tests.scheduler.fake_worker import FakeWorker

VOCAB, PAGE = 32, 4
PLAIN = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)


def slow_scheduler(monkeypatch, seconds: float, **config) -> tuple[Scheduler, FakeWorker]:
    """A scheduler whose every compile takes `seconds` (then fails as a bad constraint)."""
    started: list[str] = []

    def run(self, handle, key):
        handle.started = time.monotonic()
        started.append(handle.text)
        try:
            time.sleep(seconds)
            raise ValueError(f"sampling_params.{handle.kind} cannot be compiled: test")
        finally:
            with self._lock:
                if self._inflight.get(key) is handle:
                    del self._inflight[key]

    monkeypatch.setattr(GrammarCompiler, "_run", run)
    cfg = EngineConfig(page_size=PAGE, max_total_tokens=64 * PAGE, chunked_prefill_size=64,
                       debug_invariants=True, **config)
    info = WorkerInfo(model_path="fake", num_blocks=64, page_size=PAGE, context_length=1024,
                      vocab_size=VOCAB, eos_token_ids=[0], device="cpu", dtype="float32",
                      kv_pool_bytes=0)
    sched = Scheduler(cfg, info)
    sched.started = started  # type: ignore[attr-defined]
    return sched, FakeWorker(64, PAGE, VOCAB)


def constrained(rid: str, regex: str) -> TokenizedRequest:
    return TokenizedRequest(rid=rid, input_ids=[5, 6, 7], sampling=SamplingParams(
        max_new_tokens=3, temperature=0, regex=regex))


def step(sched: Scheduler, worker: FakeWorker) -> list:
    batch, updates = sched.schedule()
    if batch is not None:
        updates += sched.process_result(batch, worker.forward(batch.forward))
    return updates


def test_a_slow_compile_leaves_the_loop_to_the_others(monkeypatch):
    sched, worker = slow_scheduler(monkeypatch, 0.4, max_grammar_compile_seconds=0.1)
    try:
        began = time.monotonic()
        for i in range(30):  # thirty slow constraints in one step
            sched.add_request(constrained(f"slow{i}", f"[0-9]{{{i + 1}}}"))
        sched.add_request(TokenizedRequest(rid="plain", input_ids=[5, 6, 7], sampling=PLAIN))
        assert time.monotonic() - began < 1.0  # nothing waited for a compile
        finished = []
        while "plain" not in finished:
            finished += [u.rid for u in step(sched, worker) if u.finished]
        assert time.monotonic() - began < 1.0  # the plain one ran to its end meanwhile
        rejected: dict[str, str] = {}
        deadline = time.monotonic() + 60
        while len(rejected) < 30 and time.monotonic() < deadline:
            step(sched, worker)
            rejected.update((rid, message) for rid, _, message in sched.constraints.take_rejections())
            time.sleep(0.01)
        assert len(rejected) == 30  # each failed by itself, with the limit named: its own
        # compile ran past it, or it waited past it for one of the two threads
        assert all("max_grammar_compile_seconds=0.1" in m or "grammar_compile_threads=2" in m
                   for m in rejected.values()), rejected
        assert threading.active_count() < 10  # two compile threads, not thirty
        assert not sched.constraints.pending and not sched.groups
    finally:
        sched.grammars.close()


def test_a_saturated_compiler_refuses(monkeypatch):
    sched, worker = slow_scheduler(monkeypatch, 0.5, max_pending_grammar_compiles=2)
    try:
        sched.add_request(constrained("a", "[0-9]+"))
        sched.add_request(constrained("b", "[a-z]+"))
        sched.add_request(constrained("a-again", "[0-9]+"))  # joins the compile of "a"
        with pytest.raises(OverloadedError, match="max_pending_grammar_compiles=2"):
            sched.add_request(constrained("c", "[A-Z]+"))
        assert "c" not in sched.groups
        sched.abort("a-again")  # aborted while it compiles: it ends, nothing is lost
        updates = step(sched, worker)
        assert [(u.rid, u.finish_reason["type"]) for u in updates] == [("a-again", "abort")]
        deadline = time.monotonic() + 30
        rejected: dict[str, str] = {}
        while len(rejected) < 2 and time.monotonic() < deadline:
            step(sched, worker)
            rejected.update((rid, message) for rid, _, message in sched.constraints.take_rejections())
            time.sleep(0.01)
        assert set(rejected) == {"a", "b"} and "cannot be compiled" in rejected["a"]
        assert sched.started == ["[0-9]+", "[a-z]+"]  # "a-again" compiled nothing
        sched.check_invariants()
    finally:
        sched.grammars.close()
