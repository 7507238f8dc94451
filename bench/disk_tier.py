"""The disk tier: a workload of many long system prompts whose KV does not fit the pool.

`--prompts` distinct system prompts of `--prompt-tokens` tokens, `--questions` questions
each, all in one random order, `--concurrency` requests in flight; the KV pool holds
`--pool-prompts` of the prompts. Run once with the memory tier only (an evicted prompt is
prefilled again) and once with `kv_disk_dir` (it comes back from disk); greedy outputs must
be equal. Then the warm restart: the disk engine is shut down (writing its cache out), a new
one starts on the same directory, and the TTFT of a repeated system prompt (a new question)
is set against a cold prefill of it.

    python bench/disk_tier.py [--preset quick|full]

Writes `bench/results/disk_tier[_quick].{json,md}` with the commit, the machine's measured
limits, and the worker's own start-up measurements (a token's prefill against its load).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import machine_info, measure_limits
from bench.report import save_table
from radixserve import Engine
from radixserve.config import DEFAULT_MODEL
from radixserve.model.loader import load_tokenizer, resolve_model

PRESETS = {
    "quick": dict(prompts=12, questions=3, prompt_tokens=500, pool_prompts=3),
    "full": dict(prompts=40, questions=4, prompt_tokens=1000, pool_prompts=8),
}


def system_prompt(tokenizer: Any, i: int, n: int) -> list[int]:
    """A distinct `n`-token system prompt: its first page already differs from the others'."""
    ids = tokenizer.encode(f"Handbook {i} of the regional archive. ")
    j = 0
    while len(ids) < n:
        ids += tokenizer.encode(f"Section {i}.{j}: records of shelf {(i * 37 + j) % 101} are "
                                f"kept in room {(i + j * 11) % 23} and lent for {j % 9 + 1} days. ")
        j += 1
    return ids[:n]


def question(tokenizer: Any, i: int, q: int) -> list[int]:
    return tokenizer.encode(f" Question {q}: where are the records of shelf {(i * 3 + q) % 101}?")


def run(model_dir: Path, requests: list[list[int]], pool: int, new_tokens: int,
        concurrency: int, disk_dir: str | None) -> dict[str, Any]:
    engine = Engine(str(model_dir), max_total_tokens=pool, kv_disk_dir=disk_dir)
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool_:
        results = list(pool_.map(lambda ids: engine.generate(input_ids=ids,
                                                             sampling_params=params), requests))
    wall = time.perf_counter() - start
    stats = engine.stats()
    ttft = sorted(r["meta_info"]["ttft"] for r in results)
    row = {
        "mode": "memory + disk" if disk_dir else "memory only",
        "requests": len(requests), "wall_s": wall, "requests_per_s": len(requests) / wall,
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
        "hit_rate": stats["cache_hit_rate"], "prefill_tokens": stats["prefill_tokens"],
        "disk_hit_tokens": stats.get("disk_hit_tokens", 0),
        "disk_loads": stats.get("disk_loads", 0), "disk_stores": stats.get("disk_stores", 0),
        "disk_used_bytes": stats.get("disk_used_bytes", 0),
        "load_ms_per_token": engine.info.disk_load_seconds_per_token * 1e3,
        "prefill_ms_per_token": engine.info.prefill_seconds_per_token * 1e3,
        "outputs": [r["output_ids"] for r in results],
    }
    engine.shutdown()
    return row


def restart(model_dir: Path, disk_dir: str, pool: int, prompt: list[int],
            new_question: list[int]) -> dict[str, Any]:
    """TTFT of a repeated system prompt after a restart on `disk_dir`, against cold."""
    params = {"max_new_tokens": 1, "temperature": 0}
    cold_engine = Engine(str(model_dir), max_total_tokens=pool)
    cold = cold_engine.generate(input_ids=prompt + new_question, sampling_params=params)
    cold_engine.shutdown()
    start = time.perf_counter()
    warm_engine = Engine(str(model_dir), max_total_tokens=pool, kv_disk_dir=disk_dir)
    start_s = time.perf_counter() - start
    warm = warm_engine.generate(input_ids=prompt + new_question, sampling_params=params)
    warm_engine.shutdown()
    assert warm["output_ids"] == cold["output_ids"], "a restart changed the answer"
    return {"cold_ttft_s": cold["meta_info"]["ttft"], "warm_ttft_s": warm["meta_info"]["ttft"],
            "ratio": warm["meta_info"]["ttft"] / cold["meta_info"]["ttft"],
            "disk_tokens": warm["meta_info"]["cached_tokens_details"]["disk"],
            "engine_start_s": start_s}


def markdown(report: dict) -> str:
    a, rows, r = report["args"], report["runs"], report["restart"]
    lines = [
        f"# Disk tier ({report['preset']}): {a['prompts']} system prompts of "
        f"{a['prompt_tokens']} tokens x {a['questions']} questions, pool of "
        f"{a['pool_prompts']} prompts ({report['pool_tokens']} tokens)", "",
        f"commit {report['machine']['commit']}, {report['machine']['cpu']}, "
        f"{report['machine']['cores']} cores; {a['concurrency']} requests in flight, "
        f"{a['new_tokens']} new tokens each; limits: {report['limits']}", "",
        "| mode | requests/s | vs memory only | TTFT p50 s | TTFT p99 s | hit rate | "
        "prefill tokens | disk loads |", "|---|---|---|---|---|---|---|---|"]
    base = rows[0]["requests_per_s"]
    for row in rows:
        lines.append(
            f"| {row['mode']} | {row['requests_per_s']:.3f} | {row['requests_per_s'] / base:.2f}x"
            f" | {row['ttft_p50_s']:.2f} | {row['ttft_p99_s']:.2f} | {row['hit_rate']:.3f} | "
            f"{row['prefill_tokens']} | {row['disk_loads']} |")
    disk = rows[1]
    lines += ["", f"Greedy outputs equal in both modes: {report['outputs_equal']}. The worker "
              f"measured a token at {disk['prefill_ms_per_token']:.2f} ms to prefill and "
              f"{disk['load_ms_per_token']:.3f} ms to load back.", "",
              "| warm restart | cold TTFT s | TTFT after restart s | ratio | tokens from disk |",
              "|---|---|---|---|---|",
              f"| repeated system prompt | {r['cold_ttft_s']:.3f} | {r['warm_ttft_s']:.3f} | "
              f"{r['ratio']:.3f} | {r['disk_tokens']} |", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="full")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args()
    shape = PRESETS[args.preset]
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    systems = [system_prompt(tokenizer, i, shape["prompt_tokens"]) for i in range(shape["prompts"])]
    requests = [systems[i] + question(tokenizer, i, q) for i in range(shape["prompts"])
                for q in range(shape["questions"])]
    random.Random(args.seed).shuffle(requests)
    longest = max(len(r) for r in requests) + args.new_tokens
    pool = shape["pool_prompts"] * longest
    report: dict[str, Any] = {"preset": args.preset, "args": {**shape, **vars(args),
                                                              "out": str(args.out)},
                              "pool_tokens": pool, "machine": machine_info(),
                              "limits": measure_limits(quick=True)}
    with tempfile.TemporaryDirectory(prefix="radixserve-bench-kv-") as disk_dir:
        runs = [run(model_dir, requests, pool, args.new_tokens, args.concurrency, None),
                run(model_dir, requests, pool, args.new_tokens, args.concurrency, disk_dir)]
        report["outputs_equal"] = runs[0].pop("outputs") == runs[1].pop("outputs")
        report["runs"] = runs
        report["restart"] = restart(model_dir, disk_dir, pool, systems[0],
                                    question(tokenizer, 0, 99))
    name = "disk_tier" if args.preset == "full" else f"disk_tier_{args.preset}"
    save_table(report, args.out / name, markdown(report))


if __name__ == "__main__":
    main()
