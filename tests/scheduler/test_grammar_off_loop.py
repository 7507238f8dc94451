"""Grammars compile off the scheduler's loop (issue 25, class 4): `add_request` returns at
once for a constraint not yet compiled, the other requests are scheduled while it compiles,
a compile past `max_grammar_compile_seconds` fails only its request, and a saturated
compiler refuses (overloaded) instead of piling up threads."""

from __future__ import annotations

import threading
import time

import pytest

from radixserve.config import EngineConfig
from radixserve.messages import RequestRejected, SamplingParams, TokenizedRequest, WorkerInfo
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


def constrained(rid: str, regex: str, namespace: str | None = None) -> TokenizedRequest:
    """A scoped rid ("A/1") names its tenant, as the front door sets it."""
    tenant, _, _ = rid.rpartition("/")
    return TokenizedRequest(rid=rid, input_ids=[5, 6, 7], namespace=namespace,
                            sampling=SamplingParams(max_new_tokens=3, temperature=0, regex=regex),
                            **({"tenant": tenant} if tenant else {}))


def step(sched: Scheduler, worker: FakeWorker) -> list:
    batch, updates = sched.schedule()
    if batch is not None:
        updates += sched.process_result(batch, worker.forward(batch.forward))
    return updates


def take_rejections(sched: Scheduler) -> dict[str, str]:
    """The requests refused since the last call (message by rid), taken from the outbox."""
    rejected = {m.rid: m.message for m in sched.outbox if isinstance(m, RequestRejected)}
    sched.outbox.clear()
    return rejected


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
            rejected.update(take_rejections(sched))
            time.sleep(0.01)
        assert len(rejected) == 30  # each failed by itself, with the limit named: its own
        # compile ran past it, or it waited past it for one of the two threads
        assert all("max_grammar_compile_seconds=0.1" in m or "grammar_compile_threads=2" in m
                   for m in rejected.values()), rejected
        assert threading.active_count() < 10  # two compile threads, not thirty
        assert sched.constraints is not None and not sched.constraints.pending
        assert not sched.groups
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
            rejected.update(take_rejections(sched))
            time.sleep(0.01)
        assert set(rejected) == {"a", "b"} and "cannot be compiled" in rejected["a"]
        assert sched.started == ["[0-9]+", "[a-z]+"]  # "a-again" compiled nothing
        sched.check_invariants()
    finally:
        sched.grammars.close()


def rejections(sched: Scheduler, worker: FakeWorker, want: set[str]) -> dict[str, str]:
    rejected: dict[str, str] = {}
    deadline = time.monotonic() + 30
    while not want <= set(rejected) and time.monotonic() < deadline:
        step(sched, worker)
        rejected.update(take_rejections(sched))
        time.sleep(0.01)
    return rejected


def test_a_tenant_holds_its_share_of_threads_and_its_refusals_stay_its_own(monkeypatch):
    """Issue 41, findings 7 and 8: tenant A's slow compiles hold one of the two threads
    (the other is B's), and after A's schema ran past the deadline B is not told so."""
    sched, worker = slow_scheduler(monkeypatch, 0.4, max_grammar_compile_seconds=0.1)
    try:
        sched.add_request(constrained("A/1", "[0-9]+", "ns-a"))
        with pytest.raises(OverloadedError, match="max_grammar_compiles_per_tenant=1"):
            sched.add_request(constrained("A/2", "[a-z]+", "ns-a"))
        sched.add_request(constrained("B/1", "[a-z]+", "ns-b"))  # the other thread is B's
        rejected = rejections(sched, worker, {"A/1", "B/1"})
        assert "max_grammar_compile_seconds=0.1" in rejected["A/1"], rejected
        # A's text is refused at once in A's namespace ...
        with pytest.raises(ValueError, match="did not compile within"):
            sched.add_request(constrained("A/3", "[0-9]+", "ns-a"))
        # ... while B's same text starts a compile of its own once B's thread is free
        # (B's first compile runs on past its deadline: B waits, as overloaded, till then)
        deadline = time.monotonic() + 10
        while True:
            try:
                sched.add_request(constrained("B/2", "[0-9]+", "ns-b"))
                break
            except OverloadedError as e:
                assert "per_tenant" in str(e) and time.monotonic() < deadline
                time.sleep(0.02)
        assert sched.constraints is not None and sched.constraints.pending == 1
        assert rejections(sched, worker, {"B/2"})["B/2"].count("max_grammar_compile_seconds")
        assert not sched.groups
        sched.check_invariants()
    finally:
        sched.grammars.close()


def test_a_deep_constraint_is_refused_before_it_compiles():
    """Issue 41, finding 7: arrays nested 960 deep compiled for 47 s; past
    `max_constraint_depth` such a schema is refused by name at the edge, in one pass."""
    from radixserve.messages.fields import nesting_depth
    from radixserve.front_door.requests import check_sampling_limits
    schema = '{"type": "integer"}'
    for _ in range(960):
        schema = '{"type": "array", "items": ' + schema + "}"
    with pytest.raises(ValueError, match="json_schema nests 961 deep.*max_constraint_depth=32"):
        check_sampling_limits(SamplingParams(json_schema=schema), EngineConfig())
    # brackets inside JSON strings or escaped in a regex do not count
    assert nesting_depth('{"pattern": "((((((("}') == 1
    assert nesting_depth(r"\(\(\([0-9]+", quoted=False) == 1
    check_sampling_limits(SamplingParams(regex=r"(\((a|b)\))+"), EngineConfig())
