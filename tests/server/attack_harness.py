"""The two-tenant attack harness (issue 41): a live server with two tenants and an operator,
and one check that an attack by one tenant leaves the other unaffected.

Use it from a test module in three steps:

    from tests.server.attack_harness import AttackServer, assert_unaffected, attack_server

    @pytest.fixture(scope="module")
    def server(tmp_path_factory):
        with attack_server(tmp_path_factory, max_queued_requests=256) as s:  # any serve option
            yield s

    def test_bob_floods_the_queue(server):
        def attack(s: AttackServer) -> None:       # bob's hostile calls, over RPC or HTTP
            with pytest.raises(ServerError, match="overloaded"):
                s.bob.generate(prompt=["x"] * 4096, sampling_params={"max_new_tokens": 1})
        report = assert_unaffected(server, attack, max_latency_ratio=4, max_rss_growth_mib=300)

`attack_server` starts the server (a tiny random-weight model with the real tokenizer, so
a step costs milliseconds and a test measures scheduling, not arithmetic) with the keys
`ALICE_KEY` (tenant "alice", the victim), `BOB_KEY` (tenant "bob", the attacker) and
`OPERATOR_KEY` (`--admin-api-key`), and yields an `AttackServer`: RPC clients for each
(`alice`, `bob`, `operator`), `client(key)` for more, `http_url` and `bearer(key)` for
HTTP, `runtime` itself. At its end it checks what every server fixture checks
(`assert_server_idle`).

`assert_unaffected(server, attack, max_latency_ratio=..., max_rss_growth_mib=...)`:
1. takes the survival baseline (`tests.server.survival`: the server's pids and alice's
   greedy reference answer);
2. measures alice's plain small request (`VICTIM_CALL`) unloaded: the median of
   `samples` runs;
3. starts `attack(server)` in a thread, waits `settle_s` (so bob's load is in place), and
   times `samples` more of alice's requests while it runs; meanwhile a thread samples the
   RSS of all the server's processes (the front door and its children) every 50 ms;
4. asserts the median loaded latency over the unloaded one (the latter no less than
   `latency_floor_s`: on a shared 2-core machine, a step's jitter is tens of milliseconds,
   so a ratio of two tiny figures would be noise) is at most `max_latency_ratio`, and that
   the peak RSS minus the RSS before the attack is at most `max_rss_growth_mib`. A request
   of alice's that takes longer than `max_latency_ratio` x `victim_timeout_factor` x the
   unloaded latency (and at least 30 s) times out and fails the test, naming the attack as
   the cause; the unfixed server's victim typically never answers;
5. waits for the attack to end (at most `attack_timeout_s`; the attack should end on its
   own: a refused call, a bounded generation, or its own aborts), re-raising any exception
   it raised (so an attack may assert what bob got back, e.g. `overloaded`);
6. runs the survival check: once nothing is running or queued (within
   `conftest.DRAINED_WITHIN` s), the same processes, the same greedy answer, and every KV
   block free after the operator's flush.
It returns an `AttackReport` with the figures (for a test to assert more, or print).

Bounds: on this loaded 2-core machine pass generous bounds (3-5x latency, a few hundred
MiB), which the unfixed server still misses by far (it shows 10-100x, or no answer).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psutil
import pytest

from radixserve.client import Client
from radixserve.server.runtime import Runtime
from tests.factories import tiny_model_dir
from tests.server.conftest import DRAINED_WITHIN, assert_server_idle
from tests.server.survival import assert_survived, baseline

ALICE_KEY, BOB_KEY, OPERATOR_KEY = "sk-alice", "sk-bob", "sk-attack-operator"
ALICE, BOB = "alice", "bob"
VICTIM_PROMPT = "The quick brown fox"
VICTIM_CALL: dict[str, Any] = {"prompt": VICTIM_PROMPT,
                               "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
"""Alice's plain small request, whose latency the harness measures."""
SERVER_OPTIONS: dict[str, Any] = {"max_total_tokens": 8192, "debug_invariants": True}
"""The attack server's options, besides its keys, unless a test module passes its own."""


def bearer(key: str) -> dict[str, str]:
    """The HTTP header carrying `key`."""
    return {"Authorization": f"Bearer {key}"}


@dataclass
class AttackServer:
    """A live server with tenants alice and bob and an operator; see the module's doc."""

    runtime: Runtime
    alice: Client
    bob: Client
    operator: Client

    @property
    def rpc_address(self) -> str:
        return self.runtime.rpc_address

    @property
    def http_url(self) -> str:
        return self.runtime.http_url

    def client(self, key: str | None, timeout: float = 120) -> Client:
        """A new RPC client with `key` (close it, or use it in a `with`)."""
        return Client(self.rpc_address, timeout=timeout, api_key=key)

    def rss_mib(self) -> float:
        """The RSS of all the server's processes together, in MiB."""
        try:
            root = psutil.Process(self.runtime.process.popen.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass  # a child that ended since the listing
        return total / 2 ** 20


@contextmanager
def attack_server(tmp_path_factory: pytest.TempPathFactory, model: dict[str, Any] | None = None,
                  **options: Any) -> Iterator[AttackServer]:
    """Start the attack server (`options`: serve options replacing `SERVER_OPTIONS`';
    `model`: `tiny_model_dir`'s shapes, for a test whose attack needs costlier steps), yield
    it, and at the end check that nothing is left running and every block is free."""
    tiny = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models", **(model or {}))
    config = {**SERVER_OPTIONS, **options}
    with Runtime(str(tiny), api_key=[f"{ALICE_KEY}={ALICE}", f"{BOB_KEY}={BOB}"],
                 admin_api_key=OPERATOR_KEY, **config) as rt, \
            Client(rt.rpc_address, timeout=120, api_key=ALICE_KEY) as alice, \
            Client(rt.rpc_address, timeout=120, api_key=BOB_KEY) as bob, \
            Client(rt.rpc_address, timeout=120, api_key=OPERATOR_KEY) as operator:
        yield AttackServer(rt, alice, bob, operator)
        assert_server_idle(rt.rpc_address, api_key=OPERATOR_KEY)


@dataclass
class AttackReport:
    """What `assert_unaffected` measured: alice's latencies in seconds (unloaded, and while
    the attack ran), the server's RSS in MiB (before, and the peak while it ran)."""

    unloaded_s: list[float]
    loaded_s: list[float]
    rss_before_mib: float
    rss_peak_mib: float
    latency_floor_s: float
    attack_s: float = 0.0

    @property
    def latency_ratio(self) -> float:
        base = max(statistics.median(self.unloaded_s), self.latency_floor_s)
        return statistics.median(self.loaded_s) / base

    @property
    def rss_growth_mib(self) -> float:
        return self.rss_peak_mib - self.rss_before_mib

    def __str__(self) -> str:
        return (f"alice unloaded {[round(t, 3) for t in self.unloaded_s]} s, under attack "
                f"{[round(t, 3) for t in self.loaded_s]} s (ratio of medians "
                f"{self.latency_ratio:.2f}); server RSS {self.rss_before_mib:.0f} -> peak "
                f"{self.rss_peak_mib:.0f} MiB (+{self.rss_growth_mib:.0f}); the attack took "
                f"{self.attack_s:.1f} s")


@dataclass
class _RssWatch:
    server: AttackServer
    peak: float = 0.0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.wait(0.05):
            self.peak = max(self.peak, self.server.rss_mib())


def _timed(client: Client, timeout: float, call: dict[str, Any]) -> float:
    start = time.perf_counter()
    client.generate(**call, timeout=timeout)
    return time.perf_counter() - start


def assert_unaffected(server: AttackServer, attack: Callable[[AttackServer], Any], *,
                      max_latency_ratio: float, max_rss_growth_mib: float,
                      samples: int = 5, settle_s: float = 0.5, latency_floor_s: float = 0.1,
                      victim_timeout_factor: float = 4.0,
                      attack_timeout_s: float = 300.0,
                      victim_call: dict[str, Any] = VICTIM_CALL) -> AttackReport:
    """Run `attack(server)` (bob's hostile calls) in a thread while alice's plain requests
    run; assert her latency and the server's memory stay within the bounds, then that the
    server survived. The steps and the parameters are in the module's docstring;
    `victim_call` replaces alice's plain request (e.g. one under a LoRA adapter)."""
    before = baseline(server.alice)
    unloaded = [_timed(server.alice, 120, victim_call) for _ in range(samples)]
    base = max(statistics.median(unloaded), latency_floor_s)
    victim_timeout = max(30.0, base * max_latency_ratio * victim_timeout_factor)
    report = AttackReport(unloaded, [], server.rss_mib(), 0.0, latency_floor_s)
    watch = _RssWatch(server, report.rss_before_mib)
    watcher = threading.Thread(target=watch.run, name="attack-rss", daemon=True)
    failure: list[BaseException] = []

    def run_attack() -> None:
        try:
            attack(server)
        except BaseException as e:  # noqa: BLE001 (re-raised in the test thread)
            failure.append(e)

    attacker = threading.Thread(target=run_attack, name="attack", daemon=True)
    watcher.start()
    start = time.monotonic()
    attacker.start()
    try:
        time.sleep(settle_s)
        for _ in range(samples):
            try:
                report.loaded_s.append(_timed(server.alice, victim_timeout, victim_call))
            except TimeoutError:
                pytest.fail(f"alice's request got no answer within {victim_timeout:.0f} s "
                            f"under the attack (unloaded: {statistics.median(unloaded):.3f} s)")
        attacker.join(max(0.0, attack_timeout_s - (time.monotonic() - start)))
        report.attack_s = time.monotonic() - start
        assert not attacker.is_alive(), f"the attack did not end within {attack_timeout_s:g} s"
    finally:
        watch.stop.set()
        watcher.join()
    report.rss_peak_mib = max(watch.peak, report.rss_before_mib)
    if failure:
        raise failure[0]
    assert report.latency_ratio <= max_latency_ratio, f"alice slowed by the attack: {report}"
    assert report.rss_growth_mib <= max_rss_growth_mib, f"the server grew: {report}"
    _wait_drained(server.operator)
    assert_survived(server.alice, before, operator=server.operator)
    return report


def _wait_drained(operator: Client) -> None:
    """Until nothing runs or waits: an attack's aborts land a step or two later."""
    deadline = time.monotonic() + DRAINED_WITHIN
    while (s := operator.stats())["running"] or s["waiting"]:
        assert time.monotonic() < deadline, f"still busy {DRAINED_WITHIN} s on: {s}"
        time.sleep(0.05)


__all__ = ["ALICE", "ALICE_KEY", "BOB", "BOB_KEY", "OPERATOR_KEY", "VICTIM_CALL",
           "AttackReport", "AttackServer", "assert_unaffected", "attack_server",
           "bearer"]
