"""A warm restart through the real server, on a tiny model: `radixserve serve
--kv-disk-dir`, a 600-token system prompt, SIGTERM, start again on the same directory: the
prompt is a hit from disk (over HTTP, in `cached_tokens_details` and /metrics) and the
answer is unchanged. And a worker crash with a disk tier: the restarted pair resumes from
the saved index."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from array import array

import httpx
import msgspec
import pytest

from radixserve.cache.persist import SavedTree
from radixserve.client import Client
from radixserve.server.runtime import Runtime
from tests.factories import tiny_model_dir
from tests.server.conftest import assert_idle_and_all_free
from tests.server.survival import assert_survived, baseline
from tests.server.test_faults import wait_dead

SYSTEM = "You are a careful assistant for a shipping company. " + " ".join(
    f"Policy {i}: parcels of class {i} travel by route {i * 7 % 13} and are insured." for i in
    range(40))


def serve(model_dir, disk_dir) -> tuple[subprocess.Popen, str, str]:
    """The server with a disk tier in `disk_dir`, its HTTP URL and its start-up log."""
    return serve_with(model_dir, "--max-total-tokens", "2048", "--kv-disk-dir", str(disk_dir))


def serve_with(model_dir, *options: str) -> tuple[subprocess.Popen, str, str]:
    """`serve` of `model_dir` with `options` (on free ports), its HTTP URL and what it
    logged while starting."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixserve", "serve", "--model", str(model_dir), "--rpc-port",
         "0", "--port", "0", *options],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline, lines = time.monotonic() + 180, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if "ready: RPC at" in line:
            return proc, line.split("HTTP at ")[1].split()[0], "".join(lines)
        assert line or proc.poll() is None, "server exited during start-up:\n" + "".join(lines)
    os.killpg(proc.pid, signal.SIGKILL)  # not left running past the test
    raise AssertionError("server did not start:\n" + "".join(lines))


def ask(url: str) -> dict:
    r = httpx.post(f"{url}/generate", timeout=120, json={
        "text": SYSTEM + " Question: which route do class 3 parcels take?",
        "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
    r.raise_for_status()
    return r.json()


def stop(proc: subprocess.Popen, url: str) -> None:
    pids = httpx.get(f"{url}/health", timeout=30).json().get("pids", {})
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 0
    assert wait_dead(pids.values())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random model (the real tokenizer): what a restart keeps is the KV and the
    tree, whatever the weights; the default model's servers would only start slower."""
    return tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")


def test_sigterm_then_restart_answers_from_disk(tiny, tmp_path):
    disk = tmp_path / "kv"
    proc, url, _ = serve(tiny, disk)
    try:
        cold = ask(url)
        assert cold["meta_info"]["prompt_tokens"] > 600
        assert cold["meta_info"]["cached_tokens"] == 0
    finally:
        stop(proc, url)
    assert (disk / "index.msgpack").exists()
    proc, url, started = serve(tiny, disk)
    assert "resumed" in started
    try:
        warm = ask(url)
        details = warm["meta_info"]["cached_tokens_details"]
        assert details["disk"] >= 600, details
        assert warm["text"] == cold["text"]
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert 'radixserve_cache_hit_tokens_total{tier="disk"}' in metrics
        cache = httpx.get(f"{url}/cache", timeout=30).json()
        assert any("shipping company" in n["text"] for n in cache["nodes"])
    finally:
        stop(proc, url)


def test_a_worker_crash_with_a_disk_tier_restarts_on_the_same_store(tiny, tmp_path):
    """The restarted scheduler takes the directory over (the dead one's lock is gone) and
    resumes from the last saved index."""
    with Runtime(str(tiny), max_total_tokens=512, kv_disk_dir=str(tmp_path / "kv"),
                 kv_persist_interval=0.001) as rt, Client(rt.rpc_address, timeout=120) as c:
        prompts = [[1 + i] * 200 + [7, 8] for i in range(4)]  # each evicts the one before
        first = [c.generate(input_ids=p, sampling_params={"max_new_tokens": 4})["output_ids"]
                 for p in prompts]
        assert c.stats()["disk_tokens"] > 0
        worker = c.health()["pids"]["worker"]
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            health = c.health()
            if health["status"] == "ok" and health["pids"]["worker"] != worker:
                break
            time.sleep(0.2)
        again = c.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 4})
        assert again["output_ids"] == first[0]
        assert again["meta_info"]["cached_tokens_details"]["disk"] > 0
        assert_idle_and_all_free(c)  # the restarted processes lost no block


def test_a_tampered_index_does_not_reach_the_cache_view(tiny, tmp_path):
    """Issue 25, class 8: an index whose nodes hold a negative or out-of-vocabulary token id
    was restored as it was, and the front door's cache view (`/cache`, `cache_info`), which
    turns every node's ids into text, raised and ended the server. Such nodes are skipped
    now. The index (saved after a step, every 0.2 s) is tampered with while the scheduler
    is stopped, then the scheduler is killed, and its restarted pair resumes from it."""
    index = tmp_path / "kv" / "index.msgpack"
    with Runtime(str(tiny), max_total_tokens=512, kv_disk_dir=str(tmp_path / "kv"),
                 kv_persist_interval=0.2) as rt, Client(rt.rpc_address, timeout=120) as c:
        for i in range(10):  # the first ones are evicted to disk
            c.generate(input_ids=[1 + i] * 100 + [7, 8], sampling_params={"max_new_tokens": 4})
        assert c.stats()["disk_tokens"] > 0
        time.sleep(1.0)
        c.generate(input_ids=[9, 9], sampling_params={"max_new_tokens": 1})  # a step: saved
        scheduler = c.health()["pids"]["scheduler"]
        os.kill(scheduler, signal.SIGSTOP)
        saved = msgspec.msgpack.decode(index.read_bytes(), type=SavedTree)
        roots = [n for n in saved.nodes if n.parent == -1]
        assert len(roots) >= 3, saved.nodes  # one is left as it was
        for node, bad in zip(roots, (-5, 10**6)):
            ids = array("q", node.tokens)
            ids[0] = bad
            node.tokens = ids.tobytes()
        index.write_bytes(msgspec.msgpack.encode(saved))
        os.kill(scheduler, signal.SIGKILL)
        deadline = time.monotonic() + 120
        # One health answer for both: until the front door notices the kill, it is still
        # "ok" with the old pid, and a second call could see the new pid mid-restart.
        while not ((health := c.health())["status"] == "ok"
                   and health["pids"]["scheduler"] != scheduler):
            assert time.monotonic() < deadline, "the scheduler was not restarted"
            time.sleep(0.2)
        before = baseline(c)
        assert c.stats()["disk_tokens"] > 0  # the untouched nodes came back
        view = httpx.get(f"{rt.http_url}/cache", timeout=30)
        assert view.status_code == 200, view.text
        assert c.cache_info()["totals"]
        assert_survived(c, before)
