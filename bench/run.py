"""Run a benchmark preset: workloads x runners, machine limits and engine probes; print the table.

    python bench/run.py --preset quick                         # all workloads, all runners
    python bench/run.py --preset quick --workloads shared_prefix --runners radixserve,hf-generate
    python bench/run.py --preset full --threads 2
    python bench/run.py --preset quick --baseline f6e0644 --workloads shared_prefix,agent

Writes `bench/results/<preset>[_<workloads>].{json,md}` and `..._{throughput,ttft,hit_rate}.png`;
with `--baseline COMMIT`, the radixserve runner through this checkout and that commit in
alternating rounds instead (bench/baseline.py: `vs_baseline_<commit>[_<preset>].{json,md}`).
Workloads run one after another; within a workload every runner loads its model, runs
the whole workload, and frees it, so runners never compete for the cores.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # `python bench/run.py`: make `bench` importable
    # Appended, not prepended: a PYTHONPATH naming another checkout (bench/baseline.py)
    # must still decide which radixserve is imported.
    sys.path.append(str(Path(__file__).resolve().parent.parent))

import torch

from bench import report as reporting
from bench.machine import lifetime_peak_rss_mb, measure_limits, names_of, start_model_run
from bench.metrics import summarize
from bench.runners.base import Runner, RunResult
from bench.workloads import WORKLOADS, Encode, Workload, make_workload

RUNNERS = ("radixserve", "radixserve-nocache", "hf-generate", "hf-prefix-reuse")
PROBE_PREFILL_TOKENS = {"tiny": 64, "quick": 512, "full": 1024}
DEFAULT_REPEATS = {"no_sharing": 2}
"""The control's target is a 5% comparison, finer than this shared machine's run-to-run
noise, so its runners go twice (interleaved) and the better round counts."""


def runner_factories(model_dir: Path, engine_options: dict[str, Any],
                     hf_batch_size: int) -> dict[str, Callable[[], Runner]]:
    from bench.runners.engine import EngineRunner
    from bench.runners.hf import TransformersPrefixReuseRunner, TransformersRunner

    return {
        "radixserve": lambda: EngineRunner(model_dir, True, **engine_options),
        "radixserve-nocache": lambda: EngineRunner(model_dir, False, **engine_options),
        "hf-generate": lambda: TransformersRunner(model_dir, hf_batch_size),
        "hf-prefix-reuse": lambda: TransformersPrefixReuseRunner(model_dir, hf_batch_size),
    }


def run_workload(workload: Workload, names: list[str],
                 factories: dict[str, Callable[[], Runner]], repeats: int) -> dict[str, Any]:
    """Every runner on `workload` (`repeats` interleaved rounds, best round kept)."""
    best: dict[str, RunResult] = {}
    rounds: dict[str, list[float]] = {n: [] for n in names}
    settings: dict[str, Any] = {}
    load: dict[str, float] = {}
    for _ in range(repeats):
        for name in names:
            with factories[name]() as runner:
                settings[name] = runner.settings()
                result = runner.run(workload)
            gc.collect()
            tok_s = summarize(result.records)["output_tok_s"]
            rounds[name].append(tok_s)
            if name not in best or tok_s > summarize(best[name].records)["output_tok_s"]:
                best[name] = result
                load[name] = os.getloadavg()[0]
            print(f"  {workload.name:<14} {name:<20} {tok_s:8.2f} out tok/s  "
                  f"wall {summarize(result.records)['wall_s']:6.1f} s  cpu {result.cpu_s:6.1f} s",
                  flush=True)
    reference = best.get(reporting.REFERENCE_RUNNER)
    runs = {}
    for name in names:
        entry = reporting.run_entry(best[name], reference)
        entry["settings"] = settings[name]
        entry["rounds_output_tok_s"] = rounds[name]
        entry["loadavg_1m_after"] = load[name]
        runs[name] = entry
    return {"settings": dict(workload.settings), "seed": workload.seed,
            "requests": workload.num_requests, "repeats": repeats, "runs": runs}


def run_probes(model_dir: Path, engine_options: dict[str, Any], preset: str, limits: dict,
               encode: Encode) -> dict[str, Any]:
    from radixserve import Engine
    from radixserve.model.config import ModelConfig

    from bench.probes import ModelShape, probe_decode, probe_prefill, probe_ttft_cached

    shape = ModelShape.from_config(ModelConfig.from_dir(model_dir))
    sp = make_workload("shared_prefix", preset, encode, seed=99, groups=1, per_group=2)
    a, b = (list(r.segment) for r in sp.requests)
    n = sp.requests[0].shared_len
    with Engine(str(model_dir), **engine_options) as engine:
        engine.generate(input_ids=list(range(100, 140)), sampling_params={"max_new_tokens": 2})
        return {
            "model": shape.to_dict(),
            "prefill": probe_prefill(engine, shape, limits["matmul_gflops"],
                                     PROBE_PREFILL_TOKENS[preset]),
            "decode": probe_decode(engine, shape, limits["read_gbs"]),
            "ttft_cached": probe_ttft_cached(engine, a[:n], [a[n:], b[n:]]),
        }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=("tiny", "quick", "full"), default="quick")
    p.add_argument("--workloads", type=names_of(WORKLOADS), default=list(WORKLOADS),
                   help=f"comma-separated subset of {','.join(WORKLOADS)}")
    p.add_argument("--runners", type=names_of(RUNNERS), default=list(RUNNERS),
                   help=f"comma-separated subset of {','.join(RUNNERS)}")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for everything in the run (default: torch's default)")
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=None,
                   help="interleaved rounds of all runners per workload, the best reported "
                        f"(default 1; {DEFAULT_REPEATS} otherwise)")
    p.add_argument("--engine-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="radixserve Engine option (repeatable), e.g. chunked_prefill_size=256")
    p.add_argument("--workload-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting of the workloads' preset (repeatable), "
                        "e.g. system_tokens=998")
    p.add_argument("--no-probes", action="store_true", help="skip the single-request probes")
    p.add_argument("--baseline", metavar="COMMIT", default=None,
                   help="compare this checkout's radixserve runner with COMMIT's instead")
    p.add_argument("--rounds", type=int, default=2,
                   help="with --baseline: alternating rounds, the best of each counts")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()),
                   help="with --baseline: where its git worktree goes")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    return p.parse_args(argv)


def _key_values(pairs: list[str]) -> dict[str, Any]:
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.baseline:
        from bench.baseline import compare

        return compare(args)
    run = start_model_run(args.model, args.threads, quick_limits=args.preset == "tiny")
    model_dir, encode, limits_start = run.model_dir, run.encode, run.limits
    engine_options = _key_values(args.engine_opt)
    workload_options = _key_values(args.workload_opt)
    factories = runner_factories(model_dir, engine_options, args.hf_batch_size)

    # Probes first: their fractions use the limits measured seconds before.
    probes = {} if args.no_probes else run_probes(model_dir, engine_options, args.preset,
                                                  limits_start, encode)
    print(f"probes: {json.dumps({k: v for k, v in probes.items() if k != 'model'})}", flush=True)
    workloads: dict[str, Any] = {}
    for name in args.workloads:
        t0 = time.perf_counter()
        workload = make_workload(name, args.preset, encode, seed=args.seed, **workload_options)
        repeats = args.repeats or DEFAULT_REPEATS.get(name, 1)
        workloads[name] = run_workload(workload, args.runners, factories, repeats)
        workloads[name]["elapsed_s"] = time.perf_counter() - t0
        print(f"  {name}: {workloads[name]['elapsed_s']:.0f} s with model loads", flush=True)
    limits_end = measure_limits(quick=args.preset == "tiny")
    report = {
        "preset": args.preset, "machine": run.machine,
        "settings": {"model": args.model, "seed": args.seed, "threads": torch.get_num_threads(),
                     "repeats": args.repeats, "hf_batch_size": args.hf_batch_size,
                     "engine_options": engine_options,
                     "workload_options": workload_options, "argv": sys.argv[1:]},
        "limits": limits_start, "limits_end": limits_end,
        "workloads": workloads, "probes": probes,
        "elapsed_s": time.perf_counter() - run.started, "loadavg_at_end": os.getloadavg(),
        "lifetime_peak_rss_mb": lifetime_peak_rss_mb(),
    }
    subset = "" if args.workloads == list(WORKLOADS) else "_" + "-".join(args.workloads)
    paths = reporting.write(report, args.out / f"{args.preset}{subset}")
    print(reporting.markdown(report))
    print("wrote " + ", ".join(str(p) for p in paths))
    return report


if __name__ == "__main__":
    main()
