"""`serve --replicas 2`, then a replica killed mid-run: its calls fail fast with
replica_died, the rest carry on on the other; a server restarted at its address rejoins,
one added at run time starts taking traffic, and Ctrl-C stops everything."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from radixserve.client import Client, ServerError
from radixserve.server.runtime import Runtime
from tests.router.conftest import (PAGE, REPLICA_TOKENS, assert_replicas_idle, fleet_secret,
                                  system_prompt)

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def states(router: Client) -> dict[str, str]:
    return {w["url"]: w["state"] for w in router.workers()["workers"]}


def front_door_pid(address: str) -> int:
    with Client(address, timeout=30) as c:
        return c.health()["pids"]["front_door"]


def serve_replicas(model, count: int, log: Path) -> tuple[subprocess.Popen, str]:
    """`serve --replicas count`, with router options of its own; its log (stderr) in `log`."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixserve", "serve", "--replicas", str(count), "--model",
         str(model), "--rpc-port", "0", "--port", "0", "--page-size", str(PAGE),
         "--max-total-tokens", "2048", "--cache-secret-file", fleet_secret(),
         "--policy", "cache_aware", "--health-timeout", "4"],
        stdout=subprocess.PIPE, stderr=log.open("w"), text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "ready: RPC at" in line:
            return proc, line.split("RPC at ")[1].split()[0]
        assert line or proc.poll() is None, "serve --replicas exited during start-up"
    raise AssertionError("serve --replicas did not start")


def stream_until_end(stream, outcome: dict, i: int) -> None:
    try:
        for chunk in stream:
            if "final" in chunk:
                outcome[i] = chunk["final"]["meta_info"]["replica"]
    except ServerError as e:
        outcome[i] = (e.code, time.monotonic())


def test_a_killed_replica_fails_fast_rejoins_and_replicas_come_and_go(tiny, tmp_path):
    proc, address = serve_replicas(tiny, 2, tmp_path / "serve.log")
    extra: list[Runtime] = []
    try:
        with Client(address, timeout=120) as router:
            urls = sorted(states(router))
            assert len(urls) == 2 and set(states(router).values()) == {"ok"}
            log = (tmp_path / "serve.log").read_text()
            for i, url in enumerate(urls):  # each replica's own addresses are printed
                assert f"replica {i + 1} of 2 ready: RPC at " in log and url in log, log
            # One long stream per replica (a miss goes to the least loaded one), long
            # enough to be still running when the kill comes on a busy machine.
            long = {"temperature": 0, "max_new_tokens": 1500, "ignore_eos": True}
            streams = [router.generate(f"Go on {i}:", long, stream=True) for i in range(2)]
            assert all("token_ids" in next(s) for s in streams)
            in_flight = {w["url"]: w["in_flight"] for w in router.workers()["workers"]}
            assert sorted(in_flight.values()) == [1, 1], in_flight
            victim, survivor = urls
            outcome: dict = {}
            threads = [threading.Thread(target=stream_until_end, args=(s, outcome, i))
                       for i, s in enumerate(streams)]
            for t in threads:
                t.start()
            killed = time.monotonic()
            os.kill(front_door_pid(victim), signal.SIGKILL)
            for t in threads:
                t.join(120)
            failed = [v for v in outcome.values() if isinstance(v, tuple)]
            assert len(failed) == 1, outcome
            code, when = failed[0]
            assert code == "replica_died" and when - killed < 5, (code, when - killed)
            assert survivor in outcome.values(), "the other stream finished"
            wait_for(lambda: states(router)[victim] == "dead", 10)
            for i in range(4):  # everything after succeeds on the survivor
                assert router.generate(f"After {i}", GREEDY)["meta_info"]["replica"] == survivor

            # A server started again at the dead replica's address rejoins by itself.
            port = int(victim.rpartition(":")[2])
            extra.append(Runtime(str(tiny), rpc_port=port, page_size=PAGE,
                                 max_total_tokens=REPLICA_TOKENS,
                                 cache_secret_file=fleet_secret()))
            wait_for(lambda: states(router)[victim] == "ok")
            served = {router.generate(system_prompt(10 + i) + "Back?", GREEDY)["meta_info"][
                "replica"] for i in range(4)}
            assert victim in served, served

            # One added at run time takes traffic; one removed is forgotten.
            extra.append(Runtime(str(tiny), page_size=PAGE, max_total_tokens=REPLICA_TOKENS,
                                 cache_secret_file=fleet_secret()))
            added = extra[-1].rpc_address
            assert router.workers("add", added) == {"added": added}
            wait_for(lambda: states(router)[added] == "ok")
            served = {router.generate(system_prompt(20 + i) + "New?", GREEDY)["meta_info"][
                "replica"] for i in range(6)}
            assert added in served, served
            # A replica whose worker crashes restarts it; the router waits, then routes
            # there again, its view rebuilt for the new tree.
            with Client(added, timeout=30) as direct:
                os.kill(direct.health()["pids"]["worker"], signal.SIGKILL)
            wait_for(lambda: states(router)[added] != "ok", 10)
            wait_for(lambda: states(router)[added] == "ok")
            views = {w["url"]: w for w in router.workers()["workers"]}
            assert views[added]["view_synced"] and views[added]["cached_pages"] == 0
            assert router.generate(system_prompt(30) + "New?", GREEDY)["meta_info"][
                "replica"] == added, "a miss goes to the idlest, emptiest replica"
            assert router.workers("remove", victim) == {"removed": victim}
            assert victim not in states(router)
            try:
                router.workers("add", "http://not-an-rpc-address")
            except ServerError as e:
                assert e.code == "invalid_request" and "tcp://HOST:PORT" in e.message
            else:
                raise AssertionError("a bad address was accepted")
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole group stops
        assert proc.wait(60) == 0
        assert_replicas_idle(extra)  # the ones started here, one of them after a crash
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for rt in extra:
            rt.shutdown()
