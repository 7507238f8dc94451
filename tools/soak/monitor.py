"""The monitor: the scheduler's counters summed across restarts, and the RSS and open fds
of the server's processes."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from typing import Any

import psutil

from radixserve.client import Client, ServerError


class Monitor:
    """Polls the scheduler's counters every few seconds and adds them up across restarts
    (a restarted scheduler counts from zero), and samples the tree's RSS and fds."""

    COUNTERS = ("retractions", "evicted_tokens", "steps", "prefill_tokens", "decode_tokens",
                "prompt_tokens", "prompt_cached_tokens", "finished", "aborted")

    def __init__(self, control: Client, root_pid: int) -> None:
        self.control, self.root_pid = control, root_pid
        self.base = Counter()
        self.last: dict[str, int] = {}
        self.peak_pool_usage = 0.0
        self.peak_running = self.peak_waiting = 0
        self.samples: list[dict[str, Any]] = []
        self.t0 = time.monotonic()

    def poll(self) -> None:
        try:
            s = self.control.stats()
        except (ServerError, TimeoutError):
            return  # restarting
        if s["steps"] < self.last.get("steps", 0):  # a new scheduler
            self.base.update(self.last)
        self.last = {k: int(s.get(k, 0)) for k in self.COUNTERS}
        self.peak_pool_usage = max(self.peak_pool_usage, s["pool_usage"])
        self.peak_running = max(self.peak_running, s["running"])
        self.peak_waiting = max(self.peak_waiting, s["waiting"])

    def totals(self) -> dict[str, int]:
        return {k: self.base[k] + self.last.get(k, 0) for k in self.COUNTERS}

    def run(self, stop: threading.Event, period: float = 5.0) -> None:
        n = 0
        while not stop.wait(period):
            self.poll()
            n += 1
            if n % 6 == 0:  # every 30 s
                try:
                    tree = process_tree(self.root_pid, self.names())
                except psutil.Error:
                    continue  # the server is gone (the sentinel says why)
                self.samples.append({"t_s": round(time.monotonic() - self.t0, 1),
                                     "rss_mib": tree["rss_mib"], "fds": tree["fds"],
                                     "load_1m": round(os.getloadavg()[0], 2),
                                     "rss_mib_each": {name: p["rss_mib"] for name, p
                                                      in tree["processes"].items()}})

    def names(self) -> dict[int, str]:
        try:
            return names_of(self.control)
        except (ServerError, TimeoutError):
            return {}


def process_tree(root_pid: int, names: dict[int, str] | None = None) -> dict[str, Any]:
    """RSS (MiB) and open file descriptors of the server's processes, summed and each."""
    root = psutil.Process(root_pid)
    procs = [root, *root.children(recursive=True)]
    each = {}
    rss = fds = 0
    for p in procs:
        try:
            r, f = p.memory_info().rss, p.num_fds()
        except psutil.NoSuchProcess:
            continue
        rss, fds = rss + r, fds + f
        each[(names or {}).get(p.pid, f"pid {p.pid}")] = {
            "pid": p.pid, "rss_mib": round(r / 2 ** 20, 1), "fds": f}
    return {"rss_mib": round(rss / 2 ** 20, 1), "fds": fds, "processes": each}


def names_of(control: Client) -> dict[int, str]:
    return {pid: name for name, pid in control.health()["pids"].items()}
