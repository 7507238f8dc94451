"""Large calls' tokenization, off the front door's loop (issue 53, finding 4b).

The front door's loop serves every caller: a call that tokenizes there for seconds (a batch
of thousands of long prompts, or one whose last prompt is over the context, so that all the
others were tokenized for nothing) holds every other caller's replies and tokenization
that long. So a call of more than `INLINE_CHARS` characters of prompts is tokenized (and
checked, prompt by prompt: `build_requests`) on a small pool of threads (a fast
tokenizer's `encode` releases the GIL), and its requests are queued when it is done, back
on the loop. A call of fewer characters costs the loop at most a few milliseconds, less than
handing it over would take, and tokenizes inline.

Fairness: each tenant has at most one call on the pool, its others waiting in order
(at most `MAX_WAITING` of them; past that, `run` refuses: the caller's `overloaded`),
so one tenant's big batches never queue another's behind them, and a tenant's big calls
together hold at most one thread. What a call may tokenize at all is bounded before it
gets here (`check_call_chars`).
"""

from __future__ import annotations

import os
import queue
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

INLINE_CHARS = 16 * 1024
"""Characters of prompts a call may tokenize on the loop (~10-25 ms, by the text)."""
WORKERS = 2
"""Threads tokenizing: as many tenants' big calls tokenize at once."""
MAX_WAITING = 8
"""A tenant's big calls waiting behind its own running one, each holding its text."""
WAITING_FULL = (f"{MAX_WAITING} calls of more than {INLINE_CHARS} prompt characters wait to "
                "be tokenized for this tenant already")


@dataclass
class _Job:
    tenant: str
    key: Any
    work: Callable[[], Any]
    then: Callable[[Any], None]
    """Called on the loop with what `work` returned, or the exception it raised."""


class Tokenizing:
    """The pool, and each tenant's big calls: `run` one, `take` (the loop, when `fd` is
    readable) calls each finished one's `then`; `cancel` forgets a caller's (gone). `keys`:
    the calls tokenizing or waiting to (a running one cancelled, until it is taken)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="tokenize")
        self._done: queue.SimpleQueue[tuple[_Job, Any]] = queue.SimpleQueue()
        self.fd, self._wake = os.pipe()  # the loop polls `fd` beside its sockets
        os.set_blocking(self.fd, False)
        os.set_blocking(self._wake, False)
        self._running: dict[str, _Job] = {}
        self._waiting: dict[str, deque[_Job]] = {}
        self._cancelled: set[Any] = set()
        self.keys: set[Any] = set()

    def run(self, tenant: str, key: Any, work: Callable[[], Any],
            then: Callable[[Any], None]) -> bool:
        """Tokenize call `key` of `tenant` (`work`) when its earlier ones are done; False
        if `MAX_WAITING` of them wait already."""
        job = _Job(tenant, key, work, then)
        if tenant in self._running:
            waiting = self._waiting.setdefault(tenant, deque())
            if len(waiting) >= MAX_WAITING:
                return False
            waiting.append(job)
        else:
            self._start(job)
        self.keys.add(key)
        return True

    def cancel(self, gone: Callable[[Any], bool]) -> None:
        """Forget the calls whose keys `gone` is true of (their caller left): a waiting one
        never runs; a running one's result is dropped."""
        for tenant, waiting in self._waiting.items():
            self.keys.difference_update([j.key for j in waiting if gone(j.key)])
            self._waiting[tenant] = deque(j for j in waiting if not gone(j.key))
        self._cancelled.update(j.key for j in self._running.values() if gone(j.key))

    def take(self) -> None:
        """On the loop: each finished call's `then`, and its tenant's next call started."""
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                job, result = self._done.get_nowait()
            except queue.Empty:
                return
            del self._running[job.tenant]
            waiting = self._waiting.get(job.tenant)
            if waiting:
                self._start(waiting.popleft())
            elif waiting is not None:
                del self._waiting[job.tenant]  # no state kept per idle tenant
            self.keys.discard(job.key)
            if job.key in self._cancelled:
                self._cancelled.discard(job.key)
            else:
                job.then(result)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        os.close(self.fd)
        os.close(self._wake)

    def _start(self, job: _Job) -> None:
        self._running[job.tenant] = job
        self._pool.submit(self._work, job)

    def _work(self, job: _Job) -> None:  # a pool thread
        try:
            result = job.work()
        except BaseException as e:  # noqa: BLE001 (the loop's `then` gets it)
            result = e
        self._done.put((job, result))
        try:
            os.write(self._wake, b"\0")
        except BlockingIOError:  # the pipe is full: the loop has been woken already
            pass
