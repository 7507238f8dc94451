"""Speculative decoding off costs nothing per step (issue 42): with the defaults the
scheduler never asks the drafter, and one request that opts in is drafted for."""

from __future__ import annotations

from radixserve.messages import SamplingParams, TokenizedRequest
from radixserve.speculative.drafter import Drafter
from tests.scheduler.test_namespaces import new_scheduler


def _proposals(monkeypatch, speculative: str | None) -> int:
    calls = []
    real = Drafter.propose
    monkeypatch.setattr(Drafter, "propose", lambda self, *a: calls.append(1) or real(self, *a))
    sched, worker = new_scheduler()
    sched.add_request(TokenizedRequest(rid="r", input_ids=[1, 2, 3, 1, 2, 3, 1, 2], sampling=(
        SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True,
                       speculative=speculative))))
    while sched.has_work:
        batch, _ = sched.schedule()
        if batch is not None:
            sched.process_result(batch, worker.forward(batch.forward))
    sched.check_invariants()
    return len(calls)


def test_the_drafter_is_not_asked_with_the_defaults(monkeypatch):
    assert _proposals(monkeypatch, None) == 0
    assert _proposals(monkeypatch, "lookup") > 0  # the count is live: a request may opt in
