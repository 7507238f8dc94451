"""A phase of traffic (warm-up or soak): every thread started, stopped and joined; then the
idle settle and the phase's summary."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

from tools.soak.attacks import attacker_thread, summarize_attacks
from tools.soak.chaos import chaos_thread
from tools.soak.http_traffic import http_thread
from tools.soak.killer import killer_thread
from tools.soak.monitor import Monitor
from tools.soak.rpc_traffic import async_thread, rpc_thread
from tools.soak.state import EXPECTED_IN_KILL_WINDOW, Failure, Phase, Soak
from radixserve.client import Client, ServerError


# -- phases ------------------------------------------------------------------------------
def run_traffic(soak: Soak, phase: Phase, seconds: float, kill_every: float | None,
                monitor: Monitor, control: Client) -> list[dict[str, Any]]:
    """Run every traffic thread for `seconds` (or until `--max-requests`), the killer too
    if `kill_every`, the attacker if `--attack-every`; then stop and wait for every call to
    end (or for the sentinel to find the server gone). Returns the restarts."""
    a = soak.args
    phase.started = time.monotonic()
    soak.phase = phase
    soak.stop.clear()
    until = time.monotonic() + seconds
    clients = [Client(soak.rpc_address, timeout=a.call_timeout, api_key=key)
               for key in (soak.key(i) for i in range(len(soak.keys)))]
    threads = [threading.Thread(target=rpc_thread,
                                args=(soak, clients[i % len(clients)], a.seed * 1000 + i),
                                name=f"rpc-{i}") for i in range(a.rpc_threads)]
    threads += [threading.Thread(target=http_thread,
                                 args=(soak, a.seed * 1000 + 100 + i, soak.key(i)),
                                 name=f"http-{i}") for i in range(a.http_threads)]
    threads.append(threading.Thread(target=async_thread, args=(soak, a.async_tasks,
                                                               a.seed * 1000 + 200),
                                    name="async"))
    threads.append(threading.Thread(target=chaos_thread, args=(soak, a.seed * 1000 + 300),
                                    name="chaos"))
    if a.attack_every > 0 and a.attacks:
        threads.append(threading.Thread(target=attacker_thread,
                                        args=(soak, a.seed * 1000 + 400), name="attacker"))
    restarts: list[dict[str, Any]] = []
    killer = None
    if kill_every:
        killer = threading.Thread(target=killer_thread,
                                  args=(soak, control, kill_every, until, restarts),
                                  name="killer")
        threads.append(killer)
    monitor_stop = threading.Event()
    mon = threading.Thread(target=monitor.run, args=(monitor_stop,), name="monitor")
    mon.start()
    for t in threads:
        t.start()
    while time.monotonic() < until and soak.running() and any(t.is_alive() for t in threads):
        time.sleep(1.0)
        elapsed = time.monotonic() - phase.started
        if int(elapsed) % 30 == 0:
            print(f"[soak] {phase.name} {elapsed:.0f}s: {dict(phase.outcomes)}", flush=True)
    soak.stop.set()
    stuck = []
    deadline = time.monotonic() + a.call_timeout + 60
    for t in threads:
        t.join(max(1.0, deadline - time.monotonic()))
        if t.is_alive():
            stuck.append(t.name)
    phase.ended = time.monotonic()
    monitor_stop.set()
    mon.join()
    monitor.poll()
    for client in clients:
        client.close()
    if stuck:
        phase.failures.append(Failure(time.monotonic(), "soak", "stuck_client_thread",
                                      ", ".join(stuck)))
    return restarts


def settle(control: Client, timeout: float = 120.0) -> dict[str, Any]:
    """Wait until nothing runs or waits, flush the cache and return the stats after it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            s = control.stats()
            if s["running"] == 0 and s["waiting"] == 0 and control.flush_cache()["flushed"]:
                time.sleep(2.0)  # closed client connections reach the server's sockets
                return control.stats()
        except (ServerError, TimeoutError):
            pass
        time.sleep(0.5)
    return control.stats()


def summarize(soak: Soak, phase: Phase) -> dict[str, Any]:
    """Counts of a phase, failures split into those a kill explains and the rest."""
    expected, unexpected = Counter(), Counter()
    unexpected_examples = []
    for f in phase.failures:
        if f.reason in EXPECTED_IN_KILL_WINDOW and soak.in_kill_window(f.t):
            expected[f.reason] += 1
        else:
            unexpected[f.reason] += 1
            if len(unexpected_examples) < 20:
                unexpected_examples.append({"kind": f.kind, "reason": f.reason,
                                            "detail": f.detail})
    wall = max((phase.ended or time.monotonic()) - phase.started, 1e-9)
    o = phase.outcomes
    return {"wall_s": round(wall, 1), "sent": sum(phase.sent.values()),
            "sent_by_kind": dict(sorted(phase.sent.items())),
            "completed": o["completed"], "aborted": o["aborted"],
            "disconnected": o["disconnected"], "refused": o["refused"],
            "failed": o["failed"], "wrong_answers": o["wrong"],
            "greedy_checked": phase.greedy_checked,
            "failed_expected": dict(expected), "failed_unexpected": dict(unexpected),
            "unexpected_examples": unexpected_examples, "wrong_examples": phase.wrong[:20],
            "output_tokens": phase.output_tokens,
            "attacks": summarize_attacks(phase, soak.in_kill_window, EXPECTED_IN_KILL_WINDOW),
            "completed_per_min": round(o["completed"] / wall * 60, 1),
            "output_tok_s": round(phase.output_tokens / wall, 2)}
