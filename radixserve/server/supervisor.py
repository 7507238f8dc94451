"""Starts, watches, restarts and stops the scheduler and worker processes."""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Callable

from radixserve.config import ServerConfig
from radixserve.disk_layout import pin
from radixserve.model.loader import resolve_model
from radixserve.results.errors import ErrorCode
from radixserve.server.processes import (WATCHDOG_EXIT, IpcPaths, scheduler_main, start_ranks,
                                         worker_main)
from radixserve.server.spawn import Child, describe_exit
from radixserve.worker.tensor_parallel import rendezvous

log = logging.getLogger(__name__)
DISK_CLOSE_TIMEOUT = 120.0
"""Seconds a stopping scheduler has to write the cache to the disk tier (a full 64k-token
pool of a small model is a few GB at disk speed) before it is killed."""


class RestartBudget:
    """How many crashes the server survives: at most `limit` restarts within any `window`
    seconds (0: within the server's life). Older crashes stop counting, so crashes far
    apart (a rare fault, a burst an attacker caused) never add up to a shutdown; only a
    crash loop does."""

    def __init__(self, limit: int, window: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.window, self.clock = limit, window, clock
        self._crashes: deque[float] = deque()

    def crashed(self) -> bool:
        """Count a crash now; True if a restart is still allowed."""
        now = self.clock()
        self._crashes.append(now)
        while self.window > 0 and self._crashes and self._crashes[0] <= now - self.window:
            self._crashes.popleft()
        return len(self._crashes) <= self.limit

    @property
    def recent(self) -> int:
        """The crashes that count now (within the window), the latest included."""
        return len(self._crashes)


class Supervisor:
    """The front door's children. Its loop calls `check()` when a child's sentinel turns
    readable (the child exited)."""

    def __init__(self, config: ServerConfig, model_dir: Path, eos_token_ids: list[int],
                 cache_secret: bytes = b"", disk_fd: int | None = None) -> None:
        self.config, self.model_dir, self.eos_token_ids = config, model_dir, eos_token_ids
        self.cache_secret = cache_secret
        """Handed to each scheduler (over its stdin pipe, as all its arguments)."""
        self.disk_fd = disk_fd
        """The disk tier's directory as the front door pinned it at start, handed to each
        scheduler and worker (restarted ones too), which never open its path again."""
        self.ipc_dir = tempfile.mkdtemp(prefix="radixserve-")
        self.paths = IpcPaths(self.ipc_dir)
        self.procs: dict[str, Child] = {}
        self.restarts = RestartBudget(config.max_worker_restarts, config.worker_restart_window)
        self.state = "starting"
        """starting, ok, restarting or dead (the front door sets ok once ready)."""
        self.failure_code = ErrorCode.WORKER_DIED
        """The error code of the last failure `check()` reported: worker_died, or
        worker_hung when the scheduler's watchdog saw a worker step never finish."""

    def start(self) -> None:
        # Children inherit the environment, OMP_WAIT_POLICY included (radixserve/__init__.py).
        # Started as `python -c` children (spawn.py), not multiprocessing ones, which would
        # re-import this process's main module first: whatever script started the server.
        engine_config = self.config.engine_config()
        # Tensor parallelism: the worker is rank 0, the others this host's further ranks.
        meet = (rendezvous(engine_config.dist_init_addr, self.ipc_dir)
                if engine_config.tp_size > 1 else None)
        fds = () if self.disk_fd is None else (self.disk_fd,)
        self.procs = {
            "worker": Child(worker_main, (engine_config, str(self.model_dir), self.paths,
                                          meet, self.disk_fd), name="radixserve-worker",
                            pass_fds=fds),
            "scheduler": Child(
                scheduler_main, (engine_config, str(self.model_dir), self.eos_token_ids,
                                 self.paths, self.config.watchdog_timeout, self.cache_secret,
                                 self.disk_fd),
                name="radixserve-scheduler", pass_fds=fds),
        }
        if meet is not None:
            self.procs.update((rank.name, rank) for rank in
                              start_ranks(engine_config, str(self.model_dir), meet,
                                          self.disk_fd))

    def check(self) -> str | None:
        """If a child died: stop the other, restart both (or give up) and say what happened."""
        dead = [(name, p.exitcode) for name, p in self.procs.items() if p.exitcode is not None]
        if not dead or self.state == "dead":
            return None
        name, code = dead[0]
        hung = name == "scheduler" and code == WATCHDOG_EXIT
        if hung:  # the worker may be stopped (SIGSTOP) or stuck in a kernel: no SIGTERM
            self.failure_code = ErrorCode.WORKER_HUNG
            what = (f"a worker step did not finish within watchdog_timeout="
                    f"{self.config.watchdog_timeout:g}s (--watchdog-timeout); the worker was "
                    "killed")
            self.stop_children(timeout=0.0)
        else:
            self.failure_code = ErrorCode.WORKER_DIED
            what = f"{name} process exited with code {code}"
            # With a disk tier a SIGTERM'd scheduler would finish its step first, but with
            # one side dead there is nothing it can save: stop the other at once.
            self.stop_children(timeout=0.0 if self.config.kv_disk_dir else 5.0)
        if not self.restarts.crashed():
            self.state = "dead"
            return (f"{what}; restart limit reached ({self.restarts.recent} crashes, "
                    f"max_worker_restarts={self.config.max_worker_restarts} within "
                    f"worker_restart_window={self.config.worker_restart_window:g}s), the "
                    "server is shutting down")
        self.state = "restarting"
        self.start()
        return (f"{what}; requests in flight were dropped and the scheduler and worker are "
                f"restarting ({self.restarts.recent} crashes within the restart window)")

    def stop_children(self, timeout: float = 5.0) -> None:
        """SIGTERM, and SIGKILL for what is still running after `timeout` (0: at once; a
        stopped process only ever dies of SIGKILL). The scheduler goes first: on SIGTERM it
        finishes its step and, with a disk tier, has the worker write the cache out (given
        `DISK_CLOSE_TIMEOUT` for that), so the worker is stopped only after it."""
        scheduler, worker = self.procs.get("scheduler"), self.procs.get("worker")
        if timeout > 0 and self.config.kv_disk_dir is not None and scheduler is not None \
                and worker is not None and worker.is_alive() and scheduler.is_alive():
            scheduler.terminate()
            scheduler.join(DISK_CLOSE_TIMEOUT)
        stop_all(list(self.procs.values()), timeout)

    def shutdown(self) -> None:
        self.stop_children()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def serve_node(config: ServerConfig, should_stop: Callable[[], bool]) -> int:
    """A node other than the first (`node_rank` > 0): run this host's tensor-parallel ranks,
    which join node 0's group at `dist_init_addr`, until `should_stop()`. When one exits
    (its group broke: node 0 restarted, or a rank died) all of them are started again to
    join the next group, within the restart budget; past it, returns 1."""
    logging.basicConfig(level=config.log_level.upper(), format="[radixserve] %(message)s")
    engine_config = config.engine_config()
    model_dir = str(resolve_model(config.model))
    disk = pin(config.kv_disk_dir) if config.kv_disk_dir is not None else None
    restarts = RestartBudget(config.max_worker_restarts, config.worker_restart_window)
    ranks: list[Child] = []
    try:
        while not should_stop():
            if not ranks:
                ranks = start_ranks(engine_config, model_dir,
                                    rendezvous(config.dist_init_addr, ""),
                                    None if disk is None else disk.fd)
                log.info("node %d: ranks %s joining %s", config.node_rank,
                         ", ".join(r.name for r in ranks), config.dist_init_addr)
            dead = [r for r in ranks if r.exitcode is not None]
            if dead:
                log.warning("%s: %s; restarting this node's ranks", dead[0].name,
                            describe_exit(dead[0].exitcode))
                stop_all(ranks)
                ranks = []
                if not restarts.crashed():
                    log.error("restart limit reached (max_worker_restarts=%d)",
                              config.max_worker_restarts)
                    return 1
            time.sleep(0.1)
    finally:
        stop_all(ranks)
    return 0


def stop_all(children: list[Child], timeout: float = 5.0) -> None:
    """SIGTERM to each, and SIGKILL to what still runs after `timeout` (0: SIGKILL at
    once; a stopped process only ever dies of it)."""
    for child in children:
        if child.is_alive():
            child.kill() if timeout <= 0 else child.terminate()
    deadline = time.monotonic() + timeout
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            child.kill()
            child.join()
