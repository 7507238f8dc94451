"""Tensor parallelism on one host's CPU: a decode step over 2 ranks against the same step
in one process, and what the 2-rank step's collectives cost.

    python bench/tp.py --preset quick    # batch 1 and 64 x context 256 (~40 s on 2 cores)
    python bench/tp.py --preset tiny     # seconds (the smoke test's)
    python bench/tp.py --model DIR       # another model (heads divisible by 2)

Two engines side by side in this process, driven without requests: `Engine(tp_size=1)`
with all the host's cores (`--threads`, default every core) and `Engine(tp_size=2)`,
whose rank 0 runs here and rank 1 in a child process, one core each (the worker divides
the host's cores between its ranks). Each takes the same hand-built decode steps (as in
`bench/cascade_decode.py`; no shared prefixes, every sequence `context` tokens long, one
new token each) through its rank 0's `Worker.forward`: for N=2 that is the real step,
sharing the batch with rank 1 and meeting it in every collective. N=1 also runs with one
rank's threads: what N=2 would take were splitting the work all it did, and on a shared
machine the reference that a neighbour's load disturbs least (a team of every core waits
for its slowest thread). They alternate step by step (this machine's memory bandwidth
swings 2-3x from minute to minute), torch's thread count set for each before its step
(the N=2 worker set it for this whole process as it started); a figure is the median of
`steps` rounds after a warm-up round, a ratio the median of the rounds' own.

Rank 0's collectives are timed by wrapping its `TPGroup` methods: `all_reduce` (the
embedding's and two per layer), `gather_columns` (the logits) and `share` (the step's
broadcast). A rank's time in a collective includes waiting for the other to arrive, so
the same all-reduces are also timed alone, back to back between two fresh gloo processes
("gloo alone"): what a faster transport (a shared-memory all-reduce on one host) could
save at most, where the rest is the ranks' imbalance.

Writes `bench/results/tp_<preset>.{json,md}`.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import msgspec
import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cascade_decode import PAGE, blocks_needed, decode_batch
from bench.machine import machine_info, measure_limits, micro_args
from bench.report import save_table
from radixserve.engine import Engine
from radixserve.messages import ForwardBatch
from radixserve.model.config import ModelConfig
from radixserve.model.loader import cache_root, resolve_model
from radixserve.worker.tensor_parallel import TPGroup, rendezvous

TINY = "tiny"
"""`--model`'s default: a random Llama of the preset's `shape` (tests/factories.py), whose
heads and KV heads divide by 2."""
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(batches=[1, 8], context=64, steps=2, alone_calls=20,
                 shape=dict(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                            intermediate_size=256)),
    "quick": dict(batches=[1, 64], context=256, steps=60, alone_calls=200,
                  shape=dict(num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=4,
                             intermediate_size=1536)),
}
TIMED = ("all_reduce", "gather_columns", "share")
"""Rank 0's `TPGroup` methods timed in the N=2 steps."""
SHARE_BOUND = 0.10
"""The issue's bound: above this share of a batch-64 step, gloo's all-reduce is worth
replacing by a shared-memory one on one host."""


class Timed:
    """Stands in for one method of a `TPGroup` (as an instance attribute, which the
    layers' `self.tp.<name>(...)` finds first) and keeps its calls' times since `reset`."""

    def __init__(self, group: TPGroup, name: str) -> None:
        self.call: Callable[..., Any] = getattr(group, name)
        self.seconds: list[float] = []
        setattr(group, name, self)

    def reset(self) -> None:
        self.seconds = []

    def __call__(self, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.call(*args)
        finally:
            self.seconds.append(time.perf_counter() - start)


def step_batch(batch: int, context: int) -> ForwardBatch:
    """One decode step of `batch` unrelated sequences of `context` tokens, each fed a
    different token (so the greedy tokens of the two engines can be compared)."""
    fb = decode_batch(batch=batch, groups=batch, prefix=0, suffix=context - 1)
    return msgspec.structs.replace(fb, input_ids=[100 + 37 * i for i in range(batch)])


RUNS = ("n1", "n1_rank_threads", "n2")
"""Each round's steps: N=1 with every core, N=1 with one rank's threads, N=2."""


def measure(engines: dict[int, Engine], threads: dict[int, int], timers: dict[str, Timed],
            batch: int, context: int, steps: int) -> dict[str, Any]:
    fb = step_batch(batch, context)
    runs = {"n1": (engines[1], threads[1]), "n1_rank_threads": (engines[1], threads[2]),
            "n2": (engines[2], threads[2])}
    out: dict[str, Any] = {"batch": batch, "context": context, "load": os.getloadavg()[0]}
    step_ms: dict[str, list[float]] = {name: [] for name in RUNS}
    spent: dict[str, list[float]] = {name: [] for name in TIMED}
    first: dict[str, list[float]] = {name: [] for name in TIMED}
    calls: dict[str, int] = {}
    same = 0
    for _ in range(steps + 1):  # the first round warms every run up
        for t in timers.values():
            t.reset()
        tokens = {}
        for name in RUNS:
            engine, n_threads = runs[name]
            torch.set_num_threads(n_threads)
            start = time.perf_counter()
            result = engine.worker.forward(fb)
            step_ms[name].append((time.perf_counter() - start) * 1e3)
            tokens[name] = [o.next_token for o in result.outputs]
        for name, t in timers.items():
            spent[name].append(sum(t.seconds) * 1e3)
            first[name].append(t.seconds[0] * 1e3)
            calls[name] = len(t.seconds)
        same += tokens["n1"] == tokens["n2"]
    timed = {name: ms[1:] for name, ms in step_ms.items()}
    for name in RUNS:
        out[f"{name}_step_ms"] = statistics.median(timed[name])
    # The rounds' own ratios: each pair of steps ran within a second of each other.
    out["ratio"] = statistics.median(b / a for a, b in zip(timed["n1"], timed["n2"]))
    out["ratio_rank_threads"] = statistics.median(
        b / a for a, b in zip(timed["n1_rank_threads"], timed["n2"]))
    # A rank's first collective of a step (the embedding's all-reduce) also waits out
    # the other's later start (it receives the step first).
    out["collectives"] = {name: {"ms": statistics.median(spent[name][1:]), "calls": calls[name],
                                 "first_ms": statistics.median(first[name][1:]),
                                 "share": statistics.median(
                                     s / step for s, step in zip(spent[name][1:], timed["n2"]))}
                          for name in TIMED}
    out["same_tokens"] = same / (steps + 1)
    return out


def gloo_rank(rank: int, meet: str, shapes: list[tuple[int, int]], calls: int,
              results: Any) -> None:
    """One of two processes all-reducing float32 tensors of `shapes`, `calls` times each,
    back to back in blocks of 10 taking the shapes in turn (one thread, as an N=2 rank on
    this host); rank 0 puts the median seconds per call of each shape in `results`."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=meet, rank=rank, world_size=2)
    tensors = [torch.randn(shape) for shape in shapes]
    seconds: list[list[float]] = [[] for _ in shapes]
    for _ in range(-(-calls // 10) + 1):  # the first block of each warms up
        for t, times in zip(tensors, seconds):
            for _ in range(10):
                start = time.perf_counter()
                dist.all_reduce(t)
                times.append(time.perf_counter() - start)
    if rank == 0:
        results.put([statistics.median(times[10:]) for times in seconds])
    dist.destroy_process_group()


def gloo_alone(shapes: list[tuple[int, int]], calls: int) -> list[float]:
    """Median seconds per gloo all-reduce of each shape between two fresh processes."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as private:
        meet = rendezvous(None, private)
        ranks = [ctx.Process(target=gloo_rank, args=(rank, meet, shapes, calls, results))
                 for rank in (0, 1)]
        for p in ranks:
            p.start()
        medians = results.get(timeout=120)
        for p in ranks:
            p.join()
    return medians


def model_dir(model: str, shape: dict[str, int]) -> Path:
    if model != TINY:
        return resolve_model(model)
    from tests.factories import tiny_model_dir

    return tiny_model_dir(cache_root() / "bench-models", **shape)


def markdown(report: dict[str, Any]) -> str:
    m, lim, mc = report["machine"], report["limits"], report["model_config"]
    th = report["threads"]
    lines = [f"# Tensor parallelism on one host's CPU: preset `{report['preset']}`", "",
             f"Commit `{m['commit']}`, {m['cpu']}, {m['cores']} cores, load average at start "
             f"{m['loadavg_at_start'][0]:.2f}. Model `{report['model']}` ({mc['num_layers']} "
             f"layers, hidden {mc['hidden_size']}, {mc['num_heads']} heads, {mc['num_kv_heads']}"
             f" KV heads, intermediate {mc['intermediate_size']}, vocabulary "
             f"{mc['vocab_size']}), float32, page size {PAGE}. Measured limits (same run, "
             f"{lim['threads']} threads): fp32 matmul {lim['matmul_gflops']:.1f} GFLOP/s, "
             f"memory read {lim['read_gbs']:.1f} GB/s.", "",
             f"Decode steps, every sequence {report['context']} tokens of context. N=1: "
             f"`Engine(tp_size=1)` with {th['1']} threads, and again with one rank's "
             f"{th['2']}; N=2: `Engine(tp_size=2)`, {th['2']} thread(s) per rank, the step "
             f"timed at rank 0's `Worker.forward`. Medians of {report['steps']} rounds of the "
             "three in turn after a warm-up round; ratios: the median of the rounds' own "
             "(below 1: N=2 is faster). Same tokens: rounds whose greedy tokens N=1 and N=2 "
             "both chose. Load: the 1-minute load average as the row started (the machine is "
             "shared; this run adds about 2).", "",
             f"| batch | N=1 ms ({th['1']} threads) | N=1 ms ({th['2']} thread(s)) | N=2 ms | "
             f"N=2/N=1 | N=2/N=1 ({th['2']} thread(s)) | same tokens | load |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(
            f"| {r['batch']} | {r['n1_step_ms']:.1f} | {r['n1_rank_threads_step_ms']:.1f} | "
            f"{r['n2_step_ms']:.1f} | **{r['ratio']:.2f}** | {r['ratio_rank_threads']:.2f} | "
            f"{r['same_tokens']:.0%} | {r['load']:.1f} |")
    lines += ["", "## Rank 0's collectives in the N=2 step", "",
              "Time per step (waiting for rank 1 included) and share of the N=2 step; the "
              "first all-reduce (the embedding's) also waits out rank 1's later start; gloo "
              "alone: the same all-reduces back to back between two idle processes (the "
              "transport without the wait; the mean of a run before the steps and one after, "
              "both shown).", "",
              "| batch | all-reduce ms (calls) | all-reduce % | first all-reduce ms | gather "
              "logits ms | gather % | share step ms | share % | gloo alone ms | gloo alone % |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        c = r["collectives"]
        ar, ga, sh = c["all_reduce"], c["gather_columns"], c["share"]
        runs = " / ".join(f"{ms:.2f}" for ms in r["gloo_alone_ms_runs"])
        lines.append(
            f"| {r['batch']} | {ar['ms']:.2f} ({ar['calls']}) | {ar['share']:.1%} | "
            f"{ar['first_ms']:.2f} | {ga['ms']:.2f} | {ga['share']:.1%} | {sh['ms']:.2f} | "
            f"{sh['share']:.1%} | {r['gloo_alone_ms']:.2f} ({runs}) | "
            f"{r['gloo_alone_ms'] / r['n2_step_ms']:.1%} |")
    v = report["verdict"]
    bound = f"the issue's {SHARE_BOUND:.0%} bound"
    verdict = (f"above {bound}: a shared-memory all-reduce on one host is wanted by that "
               "measure" if v["above_bound"] else f"at or below {bound}")
    lines += ["", f"**Batch {v['batch']}: gloo's all-reduce takes {v['all_reduce_share']:.1%} "
              f"of the N=2 step** ({v['all_reduce_ms']:.1f} of {v['n2_step_ms']:.1f} ms), "
              f"{verdict}. Of it, the transport alone (gloo alone) is "
              f"{v['gloo_alone_share']:.1%} of the step: the most a faster transport could "
              "save; the rest is waiting for the other rank."]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = micro_args(__doc__, PRESETS, TINY)
    preset = PRESETS[args.preset]
    context, batches = preset["context"], preset["batches"]
    directory = model_dir(args.model, preset["shape"])
    mc = ModelConfig.from_dir(directory)
    blocks = max(blocks_needed(batch=b, groups=b, prefix=0, suffix=context - 1) for b in batches)
    options = dict(max_total_tokens=blocks * PAGE, page_size=PAGE, device="cpu",
                   max_running_requests=max(batches), context_length=context + PAGE)
    threads = {1: args.threads or os.cpu_count() or 1}
    torch.set_num_threads(threads[1])
    report: dict[str, Any] = {"preset": args.preset, "model": args.model, "context": context,
                              "steps": preset["steps"], "machine": machine_info(),
                              "limits": measure_limits(),
                              "model_config": {k: getattr(mc, k) for k in (
                                  "num_layers", "hidden_size", "num_heads", "num_kv_heads",
                                  "intermediate_size", "vocab_size")}}
    # Before and after the steps: gloo's latency here moves between regimes by 2-4x.
    shapes = [(b, mc.hidden_size) for b in batches]
    alone = [gloo_alone(shapes, preset["alone_calls"])]
    engines = {1: Engine(str(directory), tp_size=1, **options)}
    try:
        engines[2] = Engine(str(directory), tp_size=2, **options)
        threads[2] = torch.get_num_threads()  # what the worker set for its rank
        report["threads"] = {str(n): t for n, t in threads.items()}
        timers = {name: Timed(engines[2].worker.tp, name) for name in TIMED}
        rows = []
        for batch in batches:
            rows.append(measure(engines, threads, timers, batch, context, preset["steps"]))
            r = rows[-1]
            print(f"batch {batch}: N=1 {r['n1_step_ms']:.1f} ms "
                  f"({r['n1_rank_threads_step_ms']:.1f} at a rank's threads), "
                  f"N=2 {r['n2_step_ms']:.1f} ms "
                  f"({r['ratio']:.2f}x), all-reduce "
                  f"{r['collectives']['all_reduce']['share']:.1%}", flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    alone.append(gloo_alone(shapes, preset["alone_calls"]))
    for i, r in enumerate(rows):
        per_step = [run[i] * r["collectives"]["all_reduce"]["calls"] * 1e3 for run in alone]
        r["gloo_alone_ms_runs"] = per_step
        r["gloo_alone_ms"] = statistics.mean(per_step)
    report["rows"] = rows
    big = max(rows, key=lambda r: r["batch"])
    report["verdict"] = {"batch": big["batch"], "n2_step_ms": big["n2_step_ms"],
                         "all_reduce_ms": big["collectives"]["all_reduce"]["ms"],
                         "all_reduce_share": big["collectives"]["all_reduce"]["share"],
                         "gloo_alone_share": big["gloo_alone_ms"] / big["n2_step_ms"],
                         "above_bound": big["collectives"]["all_reduce"]["share"] > SHARE_BOUND}
    save_table(report, args.out / f"tp_{args.preset}", markdown(report))


if __name__ == "__main__":
    main()
