"""Closed-loop load: `concurrency` threads each take their next item when the last returns."""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")


def closed_loop(work: Callable[[T], None], items: Sequence[T], concurrency: int) -> float:
    """Run `work(item)` over `items` from `concurrency` threads, each taking the next item
    (in order) when its last returns; the wall seconds. The first error a thread raised is
    raised here, after every thread has stopped taking items."""
    todo: queue.Queue = queue.Queue()
    for item in items:
        todo.put(item)
    errors: list[BaseException] = []

    def loop() -> None:
        while not errors:
            try:
                item = todo.get_nowait()
            except queue.Empty:
                return
            try:
                work(item)
            except BaseException as e:  # re-raised in the caller's thread
                errors.append(e)

    start = time.perf_counter()
    threads = [threading.Thread(target=loop) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start


def drive(one: Callable[[list[int]], tuple[float, int]], prompts: list[list[int]],
          concurrency: int) -> dict:
    """Run `one(prompt) -> (ttft_s, output_tokens)` over every prompt from `concurrency`
    threads; returns throughput and TTFT percentiles."""
    ttfts: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def work(prompt: list[int]) -> None:
        ttft, n = one(prompt)
        with lock:
            ttfts.append(ttft)
            tokens[0] += n

    wall = closed_loop(work, prompts, concurrency)
    return summary(wall, len(prompts), tokens[0], ttfts)


def summary(wall: float, requests: int, tokens: int, ttfts: list[float]) -> dict:
    ttfts = sorted(ttfts)
    return {"wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
            "requests_per_s": requests / wall, "ttft_p50_s": ttfts[len(ttfts) // 2],
            "ttft_p99_s": ttfts[int(0.99 * (len(ttfts) - 1))]}
