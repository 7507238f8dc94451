"""Crashes, signals and start-up: a killed worker fails its requests fast and is restarted
(the cache events socket staying); SIGTERM stops everything with no orphan process and no
socket file left; `Runtime` starts from any kind of main script and says why when it
cannot. A tiny model keeps the restarts quick."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Iterator

import httpx
import pytest

from radixserve.client import Client, ServerError
from radixserve.server.runtime import Runtime
from tests.factories import tiny_model_dir
from tests.server.conftest import assert_idle_and_all_free, assert_server_idle
from tests.server.test_cache_events import Subscriber


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


def long_call(c: Client, max_new_tokens: int) -> tuple[threading.Thread, dict]:
    """A long call started on its own thread: `outcome` gets its "result", or its "error"
    and when that came ("at")."""
    outcome: dict = {}

    def call() -> None:
        try:
            outcome["result"] = c.generate(input_ids=[5, 6, 7], sampling_params={
                "max_new_tokens": max_new_tokens, "ignore_eos": True})
        except ServerError as e:
            outcome["error"] = e
            outcome["at"] = time.monotonic()

    t = threading.Thread(target=call)
    t.start()
    return t, outcome


def test_kill_worker_fails_in_flight_requests_then_recovers(tiny):
    with Runtime(str(tiny), max_total_tokens=4096) as rt, Client(rt.rpc_address, timeout=120) as c:
        events = Subscriber(c.model_info()["cache_events_address"])
        epoch = events.until(lambda e: True).epoch
        pids = c.health()["pids"]
        t, outcome = long_call(c, 1500)
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
        # The cache events socket is the front door's: it stayed, and the restarted
        # scheduler's events come on it in a new epoch (a new tree), from seq 1.
        assert events.until(lambda e: e.epoch != epoch, timeout=30).seq == 1
        events.close()
        assert_idle_and_all_free(c)  # the restarted processes lost no block
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


@pytest.fixture(scope="module")
def small_queue(tiny):
    """A server that runs four requests at a time and queues at most three."""
    with Runtime(str(tiny), max_total_tokens=2048, max_running_requests=4,
                 max_queued_requests=3) as rt:
        yield rt
        assert_server_idle(rt.rpc_address)


ANSWERED_WITHIN = 30
"""Seconds a refusal may take on a busy machine: the bug it guards against is a call never
answered while the queue stays full (the worker is stopped until the test lets it go)."""
FILLER = {"max_new_tokens": 4, "ignore_eos": True}


@contextlib.contextmanager
def queue_filled(rt: Runtime, waiting: int) -> Iterator[None]:
    """`rt`'s worker stopped (SIGSTOP) in the middle of a step, one request running and
    `waiting` queued behind it. The scheduler still takes requests while it waits for the
    step, and none leaves the queue until the worker goes on: the queue holds exactly
    `waiting` when the probe is sent, however busy the machine. On exit the worker goes on
    and every filler is served in full."""
    with Client(rt.rpc_address, timeout=120) as c:
        worker = c.health()["pids"]["worker"]
        served: list[int] = []

        def fill(i: int) -> None:
            out = c.generate(input_ids=[3, 4, 6 + i], sampling_params=FILLER)
            served.append(out["meta_info"]["completion_tokens"])

        threads = [threading.Thread(target=fill, args=(i,)) for i in range(1 + waiting)]
        os.kill(worker, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 60
            for i, t in enumerate(threads):  # one at a time: the first is the running one
                t.start()
                key, count = ("running", 1) if i == 0 else ("waiting", i)
                while c.stats()[key] < count:
                    assert time.monotonic() < deadline, "the queue never filled"
                    time.sleep(0.01)
            yield
        finally:
            os.kill(worker, signal.SIGCONT)
            for t in threads:
                t.join(60)
        assert served == [FILLER["max_new_tokens"]] * len(threads), served


def test_full_queue_answers_overloaded(small_queue):
    with queue_filled(small_queue, waiting=3), \
            Client(small_queue.rpc_address, timeout=ANSWERED_WITHIN) as c:
        with pytest.raises(ServerError) as err:
            c.generate(input_ids=[3, 4, 5], sampling_params=FILLER)
        assert err.value.code == "overloaded", err.value
        assert "max_queued_requests=3" in err.value.message, err.value


REFUSED_N2 = {  # the same n=2 call on each API; without `n`, it must be served
    "/generate": {"input_ids": [3, 4, 5], "sampling_params": {"n": 2, "max_new_tokens": 2}},
    "/v1/completions": {"prompt": "Hi", "n": 2, "max_tokens": 2},
    "/v1/chat/completions": {"n": 2, "max_tokens": 2,
                             "messages": [{"role": "user", "content": "Hi"}]},
}


@pytest.mark.parametrize("api", ["rpc", *REFUSED_N2])
def test_sampled_request_refused_by_a_full_queue_is_answered_at_once(small_queue, tiny, api):
    """Issue 11, bug 1: with two requests waiting, n=2 samples overflow the queue of three,
    so the scheduler refuses the request (by its rid): each API answers `overloaded` at
    once (the bug: never), then serves."""
    if api == "rpc":
        with Client(small_queue.rpc_address, timeout=ANSWERED_WITHIN) as c:
            with queue_filled(small_queue, waiting=2):
                with pytest.raises(ServerError) as err:
                    c.generate(input_ids=[3, 4, 5], sampling_params={"n": 2, "max_new_tokens": 2})
                assert err.value.code == "overloaded", err.value
            assert c.generate(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 2},
                              timeout=60)["output_ids"]
        return
    body = {**REFUSED_N2[api], **({} if api == "/generate" else {"model": str(tiny)})}
    served = {k: v for k, v in body.items() if k != "n"}
    if api == "/generate":
        served["sampling_params"] = {"max_new_tokens": 2}
    with httpx.Client(base_url=small_queue.http_url, timeout=ANSWERED_WITHIN) as http:
        for stream in (False, True):
            with queue_filled(small_queue, waiting=2):
                r = http.post(api, json={**body, "stream": stream})
            assert r.status_code == 503 and "overloaded" in r.text, (stream, r.status_code,
                                                                     r.text)
        assert http.post(api, json=served, timeout=60).status_code == 200


def test_more_samples_than_the_queue_holds_are_invalid(small_queue):
    """n=4 can never fit a queue of three: refused as invalid at once, not 'overloaded'."""
    with Client(small_queue.rpc_address, timeout=ANSWERED_WITHIN) as c:
        with pytest.raises(ServerError) as err:
            c.generate(input_ids=[3, 4, 5], sampling_params={"n": 4, "max_new_tokens": 2})
        assert err.value.code == "invalid_request" and "max_queued_requests" in str(err.value)


RUNTIME_SCRIPT = """
from radixserve.client import Client
from radixserve.server.runtime import Runtime

with Runtime({model!r}, max_total_tokens=2048) as rt, Client(rt.rpc_address, timeout=60) as c:
    out = c.generate(input_ids=[5, 6, 7],
                     sampling_params={{"max_new_tokens": 3, "ignore_eos": True}})
    print("GENERATED", len(out["output_ids"]), repr(out["text"]))
"""


@pytest.mark.parametrize("how", ["stdin", "dash_c"])
def test_runtime_starts_from_a_script_on_stdin_or_dash_c(tiny, tmp_path, how):
    """Issue 11, bug 4: `python - <<EOF` (whose main module, "<stdin>", cannot be imported
    again) and `python -c`: no child may need the caller's main module."""
    script = RUNTIME_SCRIPT.format(model=str(tiny))
    argv, stdin = ([sys.executable, "-"], script) if how == "stdin" else (
        [sys.executable, "-c", script], None)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(argv, input=stdin, cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "GENERATED 3 " in proc.stdout, proc.stdout


def test_runtime_start_up_failures_say_why(tiny, tmp_path):
    with pytest.raises(RuntimeError, match="cannot resolve model"):
        Runtime("/nonexistent/model-dir", startup_timeout=60)
    # The worker cannot load the weights: the reason is in the worker's log, which the
    # error quotes (the front door itself only sees its children exit).
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(RuntimeError, match="worker processes exited during start-up") as err:
        Runtime(str(broken), max_total_tokens=2048, max_worker_restarts=0, startup_timeout=120)
    assert "worker failed to start" in str(err.value), err.value


@pytest.mark.parametrize("child", ["scheduler", "worker"])
def test_health_and_ready_fail_while_a_dead_child_restarts(tiny, child):
    """What a load balancer's and a picker's probes see: `/health` and `/ready` answer 503
    once the `child` died, until it is restarted and warm again."""
    with Runtime(str(tiny), max_total_tokens=4096) as rt, Client(rt.rpc_address, timeout=120) as c:
        probes = [f"{rt.http_url}/{route}" for route in ("health", "ready")]
        assert [httpx.get(p).status_code for p in probes] == [200, 200]
        os.kill(c.health()["pids"][child], signal.SIGKILL)
        down, deadline = False, time.monotonic() + 120
        while True:  # down, then up again
            codes = tuple(httpx.get(p).status_code for p in probes)
            down = down or codes == (503, 503)
            if down and codes == (200, 200):
                break
            assert time.monotonic() < deadline, (down, codes)
            time.sleep(0.02)
