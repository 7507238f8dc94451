"""Closed-loop load: `concurrency` threads each send their next prompt when the last returns."""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable


def drive(one: Callable[[list[int]], tuple[float, int]], prompts: list[list[int]],
          concurrency: int) -> dict:
    """Run `one(prompt) -> (ttft_s, output_tokens)` over every prompt from `concurrency`
    threads; returns throughput and TTFT percentiles."""
    todo: queue.Queue = queue.Queue()
    for p in prompts:
        todo.put(p)
    ttfts: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def loop() -> None:
        while True:
            try:
                prompt = todo.get_nowait()
            except queue.Empty:
                return
            ttft, n = one(prompt)
            with lock:
                ttfts.append(ttft)
                tokens[0] += n

    start = time.perf_counter()
    threads = [threading.Thread(target=loop) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return summary(time.perf_counter() - start, len(prompts), tokens[0], ttfts)


def summary(wall: float, requests: int, tokens: int, ttfts: list[float]) -> dict:
    ttfts = sorted(ttfts)
    return {"wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
            "requests_per_s": requests / wall, "ttft_p50_s": ttfts[len(ttfts) // 2],
            "ttft_p99_s": ttfts[int(0.99 * (len(ttfts) - 1))]}
