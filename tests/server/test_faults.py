"""Crashes and signals: a killed worker fails its requests fast and is restarted; SIGTERM
stops everything with no orphan process and no socket file left. A tiny model keeps the
restarts quick."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from radixserve.client import Client, ServerError
from radixserve.server.runtime import Runtime
from tests.factories import tiny_model_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def wait_dead(pids, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_kill_worker_fails_in_flight_requests_then_recovers(tiny):
    with Runtime(str(tiny), max_total_tokens=4096) as rt, Client(rt.rpc_address, timeout=120) as c:
        pids = c.health()["pids"]
        outcome: dict = {}

        def long_request():
            try:
                outcome["result"] = c.generate(input_ids=[5, 6, 7], sampling_params={
                    "max_new_tokens": 1500, "ignore_eos": True})
            except ServerError as e:
                outcome["error"] = e
                outcome["at"] = time.monotonic()

        t = threading.Thread(target=long_request)
        t.start()
        while c.stats()["running"] == 0:
            time.sleep(0.05)
        killed_at = time.monotonic()
        os.kill(pids["worker"], signal.SIGKILL)
        t.join(30)
        assert "error" in outcome, outcome
        assert outcome["error"].code == "worker_died"
        assert outcome["at"] - killed_at < 5.0
        assert not alive(pids["scheduler"]) or wait_dead([pids["scheduler"]])
        # The runtime restarts both children and serves again.
        deadline = time.monotonic() + 120
        while c.health()["status"] != "ok" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3})["output_ids"]
        new_pids = c.health()["pids"]
        assert new_pids["worker"] != pids["worker"]
    assert wait_dead(new_pids.values()), "processes left behind after shutdown"


@pytest.mark.parametrize("how", ["sigterm", "ctrl_c_to_group"])
def test_signals_stop_serve_cleanly(tiny, how):
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "radixserve-*")))
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixserve", "serve", "--model", str(tiny), "--rpc-port", "0",
         "--max-total-tokens", "2048"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True)
    address = None
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "ready: RPC at" in line:
            address = line.split("RPC at ")[1].split()[0]
            break
        assert line or proc.poll() is None, "server exited during start-up"
    assert address and address.startswith("tcp://127.0.0.1:")
    with Client(address, timeout=60) as c:
        assert c.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})["output_ids"]
        pids = c.health()["pids"]
    if how == "sigterm":
        proc.send_signal(signal.SIGTERM)
    else:  # a terminal's Ctrl-C reaches every process of the foreground group
        os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(30) == 0
    assert "restarting" not in proc.stdout.read()
    assert wait_dead(pids.values()), "orphan processes after SIGTERM"
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "radixserve-*"))) == before


def test_full_queue_answers_overloaded(tiny):
    with Runtime(str(tiny), max_total_tokens=2048, max_running_requests=1,
                 max_queued_requests=2) as rt, Client(rt.rpc_address, timeout=120) as c:
        outcomes: list = []

        def one(i: int) -> None:
            try:
                outcomes.append(c.generate(input_ids=[3, 4, 5 + i], sampling_params={
                    "max_new_tokens": 200, "ignore_eos": True})["meta_info"]["completion_tokens"])
            except ServerError as e:
                outcomes.append(e.code)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert "overloaded" in outcomes and 200 in outcomes, outcomes
        assert set(outcomes) <= {"overloaded", 200}
        assert c.flush_cache() == {"flushed": True}
        s = c.stats()
        assert s["free_blocks"] == s["num_blocks"]
