"""The worker killer: a SIGKILL every `--kill-every` seconds, then a wait for the server to
serve again and a greedy probe."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from tools.soak.state import Soak
from radixserve.client import Client, ServerError


# -- the worker killer and the monitor --------------------------------------------------
def wait_serving(control: Client, old_worker: int | None, timeout: float,
                 stop: threading.Event) -> dict | None:
    """Health once the server is ok (with a new worker pid if `old_worker`), else None
    (also once `stop` is set: the run is over)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop.is_set():
        try:
            h = control.health()
            if h["status"] == "ok" and h["pids"]["worker"] != old_worker:
                return h
        except (ServerError, TimeoutError):
            pass
        time.sleep(0.2)
    return None


def killer_thread(soak: Soak, control: Client, every: float, until: float,
                  restarts: list[dict[str, Any]]) -> None:
    """SIGKILL the worker every `every` seconds, but none in the last `every` seconds (at
    least a minute), so that the worker measured at the end has served a while, as the one
    measured at the start had; after each kill, wait for the server to serve again and
    check that it answers a greedy case right."""
    next_kill = time.monotonic() + every
    while not soak.stop.wait(max(0.0, next_kill - time.monotonic())):
        if time.monotonic() > until - max(60.0, every):
            return
        try:
            pids = control.health()["pids"]
        except (ServerError, TimeoutError):
            return  # the server is gone or hung: the sentinel or the counts say which
        window = [time.monotonic(), None]
        with soak.lock:
            soak.kill_windows.append(window)  # type: ignore[arg-type]
        os.kill(pids["worker"], signal.SIGKILL)
        health = wait_serving(control, pids["worker"], 300, soak.stop)
        window[1] = time.monotonic()
        entry: dict[str, Any] = {"at_s": round(window[0] - soak.phase.started, 1),
                                 "killed_pid": pids["worker"],
                                 "restart_s": round(window[1] - window[0], 2),
                                 "served_again": health is not None}
        if health is not None:
            case = soak.cases[0]
            try:
                r = control.generate(input_ids=case.ids, sampling_params=case.params,
                                     timeout=soak.args.call_timeout)
                entry["probe_correct"] = r["output_ids"] == case.expected
            except (ServerError, TimeoutError) as e:
                entry["probe_correct"] = False
                entry["probe_error"] = repr(e)
            entry["new_pids"] = health["pids"]
        restarts.append(entry)
        print(f"[soak] worker kill {len(restarts)}: {entry}", flush=True)
        if health is None:
            soak.stop.set()  # nothing more to learn from a server that does not come back
            return
        next_kill += every
