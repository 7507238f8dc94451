"""Radix tree microbenchmark: a long synthetic trace replayed through `RadixCache` alone.

    python bench/radix_micro.py --preset quick      # 20k requests, 2M-token capacity
    python bench/radix_micro.py --preset full       # 100k requests, 4M-token capacity

The trace: a few dozen system prompts (256-2048 tokens, Zipf-like popularity); each
request either starts a conversation (system prompt + user message) or extends a finished
one (its whole history + a new user message); every request then "generates" an output.
The replay does what the scheduler's KV manager does, with `window` requests in flight
(locked) at once: on admission `match_prefix` (all but the last token) and `lock`, then
allocate blocks for prompt + output, calling `evict` when the allocator is short; on
finish (`window` admissions later) `insert` the whole pages, drop its own blocks (the tree
keeps what it adopted), `unlock`. The capacity is far below the trace's unique tokens, so
eviction runs all along once the pool has filled.

Reports per operation: calls, calls per second of time spent in it, p50/p99/max
microseconds per call; memory per cached token (tracemalloc over a fill of a fresh tree);
and the time of one full `gc.collect()` with the final tree alive.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import tracemalloc
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.metrics import percentile
from radixserve.cache import BlockAllocator, RadixCache

PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(requests=400, systems=4, capacity_tokens=60_000, window=4),
    "quick": dict(requests=20_000, systems=32, capacity_tokens=2_000_000, window=32),
    "full": dict(requests=100_000, systems=48, capacity_tokens=4_000_000, window=64),
}
OPS = ("match", "lock", "evict", "insert", "unlock")


def make_trace(requests: int, systems: int, window: int, max_len: int = 12_000,
               seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(prompt tokens, output tokens) per request, in arrival order. A conversation can be
    continued once its last request has finished (`window` requests later), until its
    history reaches `max_len` tokens."""
    rng = np.random.default_rng(seed)
    fresh = lambda n: rng.integers(1, 50_000, size=int(n)).tolist()  # noqa: E731
    prompts = [fresh(n) for n in rng.integers(256, 2049, size=systems)]
    popularity = 1.0 / np.arange(1, systems + 1)
    popularity /= popularity.sum()
    finished: list[list[int]] = []  # histories that may be continued (most recent last)
    pending: deque[list[int]] = deque()
    trace = []
    for _ in range(requests):
        output = fresh(rng.integers(32, 257))
        if finished and rng.random() < 0.6:  # continue one of the recent conversations
            pick = len(finished) - 1 - int(rng.integers(0, min(64, len(finished))))
            prompt = finished.pop(pick) + fresh(rng.integers(32, 257))
        else:
            system = prompts[int(rng.choice(systems, p=popularity))]
            prompt = system + fresh(rng.integers(64, 257))
        trace.append((prompt, output))
        pending.append(prompt + output if len(prompt) + len(output) < max_len else [])
        if len(pending) > window:
            history = pending.popleft()
            if history:
                finished.append(history)
    return trace


class Replay:
    def __init__(self, capacity_tokens: int, page_size: int, window: int) -> None:
        self.ps, self.window = page_size, window
        self.allocator = BlockAllocator(capacity_tokens // page_size)
        self.cache = RadixCache(self.allocator, page_size)
        self.times: dict[str, list[float]] = {op: [] for op in OPS}
        self.in_flight: deque[tuple[list[int], Any, list[int]]] = deque()
        self.prompt_tokens = self.hit_tokens = 0

    def _timed(self, op: str, fn: Any, *args: Any) -> Any:
        start = time.perf_counter_ns()
        out = fn(*args)
        self.times[op].append((time.perf_counter_ns() - start) / 1e3)
        return out

    def admit(self, prompt: list[int], output: list[int]) -> None:
        m = self._timed("match", self.cache.match_prefix, prompt, len(prompt) - 1)
        self._timed("lock", self.cache.lock, m.node)
        self.prompt_tokens += len(prompt)
        self.hit_tokens += m.length
        seq = prompt + output
        need = -(-len(seq) // self.ps) - len(m.blocks)
        short = need - self.allocator.num_free
        if short > 0:
            self._timed("evict", self.cache.evict, short)
        blocks = self.allocator.alloc(need)
        if blocks is None:
            raise RuntimeError("capacity too small for the requests in flight")
        self.in_flight.append((seq, m, m.blocks + blocks))
        if len(self.in_flight) > self.window:
            self.finish()

    def finish(self) -> None:
        seq, m, blocks = self.in_flight.popleft()
        pages = len(seq) // self.ps
        self._timed("insert", self.cache.insert, seq[:pages * self.ps], blocks[:pages])
        self.allocator.free(blocks[len(m.blocks):])  # ours; the tree took its own
        self._timed("unlock", self.cache.unlock, m.node)

    def drain(self) -> None:
        while self.in_flight:
            self.finish()


def memory_per_token(trace: list[tuple[list[int], list[int]]], page_size: int, n: int) -> dict:
    """tracemalloc bytes per cached token after inserting `n` sequences into a fresh tree."""
    seqs = [p[:len(p) // page_size * page_size] for p, _ in trace[:n]]
    allocator = BlockAllocator(sum(len(s) for s in seqs) // page_size)
    cache = RadixCache(allocator, page_size)
    tracemalloc.start()
    for s in seqs:
        blocks = allocator.alloc(len(s) // page_size)
        cache.insert(s, blocks)
        allocator.free(blocks)
    used = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {"sequences": n, "cached_tokens": cache.cached_tokens, "nodes": cache.num_nodes,
            "bytes": used, "bytes_per_token": used / max(cache.cached_tokens, 1)}


def run(preset: str, page_size: int = 16, seed: int = 0) -> dict[str, Any]:
    p = PRESETS[preset]
    t0 = time.perf_counter()
    # Histories stay short enough that `window + 1` requests in flight always fit.
    max_len = min(12_000, p["capacity_tokens"] // (2 * (p["window"] + 1)))
    trace = make_trace(p["requests"], p["systems"], p["window"], max_len, seed)
    built = time.perf_counter() - t0
    trace_tokens = sum(len(pr) + len(o) for pr, o in trace)
    replay = Replay(p["capacity_tokens"], page_size, p["window"])
    start = time.perf_counter()
    for prompt, output in trace:
        replay.admit(prompt, output)
    replay.drain()
    elapsed = time.perf_counter() - start
    replay.cache.check_invariants()
    ops = {}
    for op, ts in replay.times.items():
        total = sum(ts) / 1e6
        ops[op] = {"calls": len(ts), "calls_per_s": len(ts) / total if total else None,
                   "p50_us": percentile(ts, 50), "p99_us": percentile(ts, 99),
                   "max_us": max(ts, default=0.0)}
    memory = memory_per_token(trace, page_size, min(len(trace), 2000))
    del trace  # its token lists would dominate the collector's walk below
    gc.collect()
    gc_start = time.perf_counter()
    gc.collect()
    gc_ms = (time.perf_counter() - gc_start) * 1e3
    stats = replay.cache.stats()
    return {
        "preset": preset, "settings": {**p, "page_size": page_size, "seed": seed},
        "trace_tokens": trace_tokens, "trace_build_s": built,
        "replay_s": elapsed, "requests_per_s": p["requests"] / elapsed, "ops": ops,
        "hit_rate": replay.hit_tokens / replay.prompt_tokens,
        "cached_tokens_end": stats["cached_tokens"], "nodes_end": stats["num_nodes"],
        "evicted_tokens": stats["evicted_tokens"],
        "gc_collect_ms": gc_ms, "gc_tracked_objects": len(gc.get_objects()),
        "memory": memory,
    }


def markdown(r: dict[str, Any]) -> str:
    s = r["settings"]
    lines = [f"# RadixCache microbenchmark: preset `{r['preset']}`", "",
             f"{s['requests']:,} requests over {s['systems']} system prompts, capacity "
             f"{s['capacity_tokens']:,} tokens, page size {s['page_size']}, {s['window']} in "
             f"flight; {r['trace_tokens']:,} trace tokens; replay {r['replay_s']:.1f} s "
             f"({r['requests_per_s']:,.0f} requests/s); prompt hit rate {r['hit_rate']:.1%}; "
             f"{r['evicted_tokens']:,} tokens evicted; {r['cached_tokens_end']:,} cached in "
             f"{r['nodes_end']:,} nodes at the end.", "",
             "| op | calls | calls/s | p50 us | p99 us | max us |", "|---|---|---|---|---|---|"]
    for op, o in r["ops"].items():
        if o["calls"]:
            lines.append(f"| {op} | {o['calls']:,} | {o['calls_per_s']:,.0f} | {o['p50_us']:.1f} "
                         f"| {o['p99_us']:.1f} | {o['max_us']:.0f} |")
    m = r["memory"]
    lines += ["", f"Memory: {m['bytes_per_token']:.1f} bytes per cached token "
              f"({m['cached_tokens']:,} "
              f"tokens in {m['nodes']:,} nodes, tracemalloc). A full `gc.collect()` with the final "
              f"tree alive: {r['gc_collect_ms']:.1f} ms ({r['gc_tracked_objects']:,} "
              "tracked objects).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=PRESETS, default="quick")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args(argv)
    result = run(args.preset, args.page_size, args.seed)
    from bench.machine import git_commit

    result["commit"] = git_commit()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"radix_micro_{args.preset}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
