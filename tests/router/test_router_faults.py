"""A replica killed mid-run: its calls fail fast with replica_died, the rest carry on on
the others; a replica added at run time starts taking traffic."""

from __future__ import annotations

import os
import signal
import threading
import time

from radixserve.client import Client, ServerError
from radixserve.router.runtime import RouterRuntime
from tests.router.conftest import start_replicas, stop_all, system_prompt

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def states(router: Client) -> dict[str, str]:
    return {w["url"]: w["state"] for w in router.workers()["workers"]}


def test_kill_9_fails_its_calls_fast_and_add_worker_brings_a_new_one_in(tiny):
    replicas = start_replicas(tiny, 2)
    spare = None
    try:
        with RouterRuntime(replica=[r.rpc_address for r in replicas]) as rt, \
                Client(rt.rpc_address, timeout=120) as router:
            # One long stream per replica (a miss goes to the least loaded one).
            long = {"temperature": 0, "max_new_tokens": 280, "ignore_eos": True}
            streams = [router.generate(system_prompt(i) + "Go on:", long, stream=True)
                       for i in range(2)]
            firsts = [next(s) for s in streams]
            assert all("token_ids" in f for f in firsts)
            where = {w["url"]: w["in_flight"] for w in router.workers()["workers"]}
            assert sorted(where.values()) == [1, 1], where
            victim = replicas[0]
            with Client(victim.rpc_address) as direct:
                pid = direct.health()["pids"]["front_door"]
            outcome: dict = {}

            def drain(i: int) -> None:
                try:
                    for chunk in streams[i]:
                        if "final" in chunk:
                            outcome[i] = chunk["final"]["meta_info"]["replica"]
                except ServerError as e:
                    outcome[i] = (e.code, time.monotonic())

            threads = [threading.Thread(target=drain, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            for t in threads:
                t.join(120)
            failed = [v for v in outcome.values() if isinstance(v, tuple)]
            assert len(failed) == 1, outcome
            code, when = failed[0]
            assert code == "replica_died" and when - killed < 5, (code, when - killed)
            assert replicas[1].rpc_address in outcome.values(), "the other stream finished"
            assert states(router)[victim.rpc_address] == "dead"
            for i in range(4):  # everything after succeeds on the survivor
                result = router.generate(f"After {i}", GREEDY)
                assert result["meta_info"]["replica"] == replicas[1].rpc_address

            spare = start_replicas(tiny, 1)[0]
            assert router.workers("add", spare.rpc_address) == {"added": spare.rpc_address}
            wait_for(lambda: states(router)[spare.rpc_address] == "ok")
            served = {router.generate(system_prompt(10 + i) + "New?", GREEDY)["meta_info"][
                "replica"] for i in range(4)}
            assert spare.rpc_address in served, served
            assert router.workers("remove", victim.rpc_address) == {"removed": victim.rpc_address}
            assert victim.rpc_address not in states(router)
            try:
                router.workers("add", "http://not-an-rpc-address")
            except ServerError as e:
                assert e.code == "invalid_request" and "tcp://HOST:PORT" in e.message
            else:
                raise AssertionError("a bad address was accepted")
    finally:
        stop_all(replicas + ([spare] if spare else []))
