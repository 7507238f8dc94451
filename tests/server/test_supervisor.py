"""Restart counts decay (issue 25, class 4): crashes further apart than
`worker_restart_window` never add up to a shutdown; a crash loop still ends the server.
Unit level, with a fake clock and fake children: no process is started or crashed."""

from __future__ import annotations

from pathlib import Path

from radixserve.config import ServerConfig
from radixserve.server.supervisor import RestartBudget, Supervisor


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_crashes_within_the_window_add_up_and_older_ones_stop_counting():
    clock = Clock()
    budget = RestartBudget(limit=3, window=600.0, clock=clock)
    assert all(budget.crashed() for _ in range(3))  # three restarts allowed
    assert not budget.crashed()  # a fourth crash within ten minutes: a crash loop
    clock.now += 601
    assert budget.crashed() and budget.recent == 1  # the old ones no longer count


def test_bursts_far_apart_never_end_the_server():
    clock = Clock()
    budget = RestartBudget(limit=3, window=600.0, clock=clock)
    for _ in range(20):  # twenty bursts of three crashes, an hour apart
        assert all(budget.crashed() for _ in range(3))
        clock.now += 3600


def test_window_zero_counts_every_crash_for_ever():
    clock = Clock()
    budget = RestartBudget(limit=2, window=0.0, clock=clock)
    assert budget.crashed()
    clock.now += 1e9
    assert budget.crashed()
    clock.now += 1e9
    assert not budget.crashed()


class _DeadChild:
    exitcode = 1


def test_supervisor_restarts_after_a_decayed_burst(monkeypatch):
    config = ServerConfig(max_worker_restarts=1, worker_restart_window=60.0)
    sup = Supervisor(config, Path("/nonexistent"), [0])
    clock = Clock()
    sup.restarts.clock = clock
    started: list[int] = []
    monkeypatch.setattr(sup, "start", lambda: started.append(1))
    monkeypatch.setattr(sup, "stop_children", lambda timeout=5.0: None)
    try:
        for _ in range(5):  # one crash a minute and more: each one is restarted
            sup.procs = {"worker": _DeadChild()}
            assert "restarting" in sup.check()
            assert sup.state == "restarting"
            clock.now += 61
        sup.procs = {"worker": _DeadChild()}
        sup.check()
        sup.procs = {"worker": _DeadChild()}
        message = sup.check()  # two within a minute: past max_worker_restarts=1
        assert sup.state == "dead" and "restart limit reached" in message
        assert len(started) == 6
    finally:
        sup.shutdown()
