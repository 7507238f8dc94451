"""A step that runs long is seen and reported (issue 53, item 1's watchdog), and the
operator's abort takes effect at the next step (item 2): with the worker stopped in the
middle of a step, the server's health turns `stalled` (503 over HTTP) within the bound,
the operator's `abort_all` is accepted meanwhile, and once the step ends the request is
aborted, the health is `ok` again and the step is counted (`slow_steps`, /metrics)."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from radixserve.client import Client
from radixserve.server.runtime import Runtime
from tests.factories import tiny_model_dir
from tests.server.conftest import assert_idle_and_all_free

STALL = 2.0
OPERATOR = "operator-key-for-the-stall-test"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tiny = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")
    with Runtime(str(tiny), max_total_tokens=4096, scheduler_stall_seconds=STALL,
                 admin_api_key=OPERATOR, port=0) as rt:
        yield rt


def wait_for(check, within: float) -> float:
    """Seconds until `check()` held (AssertionError past `within`)."""
    began = time.monotonic()
    while not check():
        assert time.monotonic() - began < within, "not within the bound"
        time.sleep(0.02)
    return time.monotonic() - began


def test_a_stalled_step_is_reported_and_the_operators_abort_lands_after_it(server):
    with Client(server.rpc_address, timeout=120, api_key=OPERATOR) as c, \
            httpx.Client(base_url=server.http_url, timeout=30) as http:
        assert c.health()["status"] == "ok" and c.stats()["slow_steps"] == 0
        answer: dict = {}
        call = threading.Thread(target=lambda: answer.update(c.generate(
            input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 1000,
                                                  "ignore_eos": True})))
        call.start()
        wait_for(lambda: c.stats()["running"] == 1, 30)
        worker = c.health()["pids"]["worker"]
        os.kill(worker, signal.SIGSTOP)  # the step in flight never ends until SIGCONT
        try:
            took = wait_for(lambda: c.health()["status"] == "stalled", 2 * STALL + 5)
            assert http.get("/health").status_code == 503
            assert c.abort_all() == {"aborted": 1}  # accepted while the step hangs
            time.sleep(STALL)  # the step has now run well past the bound
        finally:
            os.kill(worker, signal.SIGCONT)
        call.join(60)
        finish = answer["meta_info"]["finish_reason"]
        assert finish["type"] == "abort" and answer["meta_info"]["completion_tokens"] < 1000
        wait_for(lambda: c.health()["status"] == "ok", 10)
        assert http.get("/health").status_code == 200
        stats = c.stats()
        assert stats["slow_steps"] >= 1 and stats["longest_step_seconds"] > STALL, (took, stats)
        metrics = http.get("/metrics", headers={"Authorization": f"Bearer {OPERATOR}"}).text
        assert "radixserve_scheduler_slow_steps" in metrics
        assert_idle_and_all_free(c)
