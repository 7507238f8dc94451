"""The front door's pool for large calls' tokenization (front_door/tokenizing.py): one call
per tenant at a time, in order; another tenant's call does not wait behind them; a
tenant's waiting calls are bounded; a gone caller's calls are dropped; errors come back."""

from __future__ import annotations

import select
import threading
import time
from typing import Any

from radixserve.front_door.tokenizing import MAX_WAITING, Tokenizing


def drain(t: Tokenizing, until: Any, timeout: float = 10.0) -> None:
    """The loop's part: `take` whenever `fd` is readable, until `until()`."""
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "no result came back"
        if select.select([t.fd], [], [], 0.05)[0]:
            t.take()


def test_a_tenants_calls_run_in_order_and_another_tenant_passes_them() -> None:
    t = Tokenizing()
    gate = threading.Event()
    done: list[str] = []
    t.run("bob", 1, lambda: gate.wait(10) and "bob-1", done.append)
    t.run("bob", 2, lambda: "bob-2", done.append)
    t.run("alice", 3, lambda: "alice-3", done.append)
    drain(t, lambda: done == ["alice-3"])  # bob's first holds one thread, not alice's call
    assert t.keys == {1, 2}
    gate.set()
    drain(t, lambda: len(done) == 3)
    assert done == ["alice-3", "bob-1", "bob-2"]
    assert not t.keys
    t.close()


def test_waiting_calls_are_bounded_and_a_gone_callers_are_dropped() -> None:
    t = Tokenizing()
    gate = threading.Event()
    done: list[Any] = []
    assert t.run("bob", ("gone", 0), lambda: gate.wait(10), done.append)
    for i in range(MAX_WAITING):
        assert t.run("bob", ("gone", i + 1), lambda: "never", done.append)
    assert not t.run("bob", ("kept", 0), lambda: "refused", done.append)  # overloaded
    t.cancel(lambda key: key[0] == "gone")
    assert t.keys == {("gone", 0)}  # running still, its result to be dropped
    assert t.run("bob", ("kept", 1), lambda: 1 // 0, done.append)
    gate.set()
    drain(t, lambda: len(done) == 1)
    assert not t.keys
    assert isinstance(done[0], ZeroDivisionError)  # the caller's `then` gets the error
    t.close()
