"""A tensor-parallel server: RPC and HTTP answer what one rank does; a rank killed mid-step
fails the calls in flight, every rank is restarted and the next request is right; a group
spread over two "hosts" (`serve --node-rank 1` on loopback) answers the same; and the
router takes a sharded replica as any other."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from radixserve.client import Client
from radixserve.router.runtime import RouterRuntime
from radixserve.server.runtime import Runtime
from tests.conftest import checked_engine
from tests.factories import tiny_model_dir
from tests.server.conftest import assert_idle_and_all_free, assert_server_idle
from tests.server.test_faults import long_call, wait_dead

PROMPTS = [list(range(1000, 1040)), list(range(1000, 1040)) + [7, 8], [5, 6, 7] * 9]
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models", num_heads=4,
                          num_kv_heads=2)


@pytest.fixture(scope="module")
def expected(tiny):
    """One rank's greedy answers, the reference for every sharded server here."""
    with checked_engine(tiny, max_total_tokens=2048) as engine:
        return [r["output_ids"] for r in engine.generate(input_ids=PROMPTS,
                                                         sampling_params=GREEDY)]


def test_rpc_and_http_answer_as_one_rank_and_a_killed_rank_restarts_all(tiny, expected):
    with Runtime(str(tiny), tp_size=2, max_total_tokens=2048, debug_invariants=True) as rt, \
            Client(rt.rpc_address, timeout=120) as c:
        got = c.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [r["output_ids"] for r in got] == expected
        for ids, want in zip(PROMPTS, expected):
            r = httpx.post(f"{rt.http_url}/generate", timeout=120,
                           json={"input_ids": ids, "sampling_params": GREEDY})
            assert r.json()["output_ids"] == want
        pids = c.health()["pids"]
        rank = next(pid for name, pid in pids.items() if name.endswith("rank1"))
        t, outcome = long_call(c, 1500)
        while c.stats()["running"] == 0:
            time.sleep(0.05)
        os.kill(rank, signal.SIGKILL)
        t.join(60)
        assert outcome.get("error") is not None and outcome["error"].code == "worker_died"
        assert wait_dead([pids["worker"], pids["scheduler"]], 30), "rank 0 left running"
        deadline = time.monotonic() + 120
        while c.health()["status"] != "ok" and time.monotonic() < deadline:
            time.sleep(0.2)
        got = c.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [r["output_ids"] for r in got] == expected
        new_pids = c.health()["pids"]
        restarted = {name: pid for name, pid in new_pids.items() if name != "front_door"}
        assert set(restarted.values()).isdisjoint(pids.values()), (pids, new_pids)
        assert_idle_and_all_free(c)
    assert wait_dead(new_pids.values()), "processes left behind after shutdown"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_hosts_on_loopback_answer_as_one_and_rejoin_after_a_rank_dies(tiny, expected):
    """Node 1 (`serve --node-rank 1`, its own process tree) runs rank 1. Killed mid-call,
    the call fails, node 0 restarts its worker and node 1 its rank, and they meet again."""
    import psutil

    addr = f"127.0.0.1:{free_port()}"
    group = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr]
    node1 = subprocess.Popen([sys.executable, "-m", "radixserve", "serve", "--model", str(tiny),
                              "--max-total-tokens", "2048", *group, "--node-rank", "1"],
                             start_new_session=True)
    try:
        with Runtime(str(tiny), tp_size=2, nnodes=2, dist_init_addr=addr,
                     max_total_tokens=2048, debug_invariants=True) as rt, \
                Client(rt.rpc_address, timeout=120) as c:
            assert "rank1" not in " ".join(c.health()["pids"])  # node 1's, not this host's
            got = c.generate(input_ids=PROMPTS, sampling_params=GREEDY)
            assert [r["output_ids"] for r in got] == expected
            assert c.model_info()["tp_size"] == 2
            (rank1,) = psutil.Process(node1.pid).children()
            t, outcome = long_call(c, 1500)
            while c.stats()["running"] == 0:
                time.sleep(0.05)
            rank1.kill()
            t.join(60)
            assert outcome.get("error") is not None and outcome["error"].code == "worker_died"
            deadline = time.monotonic() + 120
            while c.health()["status"] != "ok" and time.monotonic() < deadline:
                time.sleep(0.2)
            got = c.generate(input_ids=PROMPTS, sampling_params=GREEDY)
            assert [r["output_ids"] for r in got] == expected
            assert psutil.Process(node1.pid).children()[0].pid != rank1.pid
            assert_idle_and_all_free(c)
    finally:
        node1.send_signal(signal.SIGTERM)
        assert node1.wait(60) == 0


def test_a_sharded_replica_behind_the_router(tiny, expected):
    """The router sends calls alike to a replica of 2 ranks and to a plain one."""
    with Runtime(str(tiny), tp_size=2, max_total_tokens=2048) as sharded, \
            Runtime(str(tiny), max_total_tokens=2048) as plain, \
            RouterRuntime(replica=[sharded.rpc_address, plain.rpc_address],
                          policy="round_robin") as router, \
            Client(router.rpc_address, timeout=120) as c:
        replicas = set()
        for ids, want in list(zip(PROMPTS, expected)) * 2:
            res = c.generate(input_ids=ids, sampling_params=GREEDY)
            assert res["output_ids"] == want
            replicas.add(res["meta_info"]["replica"])
        assert len(replicas) == 2, replicas
        for replica in (sharded, plain):
            assert_server_idle(replica.rpc_address)
