"""OpenMP's wait policy, measured both ways: the in-process Engine on the shared-prefix
workload with `OMP_WAIT_POLICY` PASSIVE (radixserve's choice), ACTIVE (common advice for
CPU inference) and unset: libgomp's default (spin a while, then sleep), since
`bench/run.py` loads torch, and with it libgomp, before radixserve would set PASSIVE.

    python bench/omp_policy.py                  # issue 10's workload (8 x 8), 2 rounds
    python bench/omp_policy.py --preset quick   # 4 x 4 prompts, ~5 minutes

Each round runs `bench/run.py`'s radixserve runner once per policy, alternating, in a fresh
process (libgomp reads the variable once, when torch loads it), so every policy sees the
same machine; the best round counts. Writes `bench/results/omp_policy[_<preset>].{json,md}`.

Why it matters: the Engine's own loop thread, the caller's threads and the tokenizer share
the cores with torch's OpenMP team. A team that spins between parallel regions keeps a core
busy that the loop thread needs, on every step.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import git_commit, machine_info, measure_limits
from bench.report import save_table
from bench.vs_baseline import ISSUE_10_WORKLOAD, ROOT, run_once

POLICIES: dict[str, str | None] = {"PASSIVE": "PASSIVE", "ACTIVE": "ACTIVE", "unset": None}
"""Each side's `OMP_WAIT_POLICY` (None: not set)."""
QUICK_WORKLOAD = ["groups=4", "per_group=4", "system_tokens=998", "question_tokens=36",
                  "output_tokens=32"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=("quick", "full"), default="full")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args()
    args.workloads = ["shared_prefix"]
    args.workload_opt = ISSUE_10_WORKLOAD if args.preset == "full" else QUICK_WORKLOAD
    limits = measure_limits()
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in POLICIES}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, policy in POLICIES.items():
                run = run_once(ROOT, args, Path(tmp) / f"{name}{r}", {"OMP_WAIT_POLICY": policy})
                rounds[name].append(run["workloads"]["shared_prefix"])
                print(f"round {r} {name}: {rounds[name][-1]['summary']['output_tok_s']:.2f} "
                      "out tok/s", flush=True)
    best = {name: max(runs, key=lambda x: x["summary"]["output_tok_s"])
            for name, runs in rounds.items()}
    base = best["PASSIVE"]["summary"]["output_tok_s"]
    report = {"commit": git_commit(ROOT), "preset": args.preset,
              "workload_opt": args.workload_opt, "machine": machine_info(), "limits": limits,
              "rounds": rounds,
              "ratios": {n: b["summary"]["output_tok_s"] / base for n, b in best.items()}}
    m = report["machine"]
    lines = [f"# OMP_WAIT_POLICY, radixserve `{report['commit']}`", "",
             f"{m['cpu']}, {m['cores']} cores, torch threads {m['torch_threads']}; measured "
             f"fp32 matmul {limits['matmul_gflops']:.1f} GFLOP/s, read {limits['read_gbs']:.1f} "
             f"GB/s. In-process Engine, shared prefix ({', '.join(args.workload_opt)}), greedy; "
             f"{args.rounds} alternating rounds, best of each.", "",
             "| OMP_WAIT_POLICY | out tok/s | × PASSIVE | TPOT p50 ms | TTFT p50 s | CPU s "
             "| rounds out tok/s |", "|---|---|---|---|---|---|---|"]
    for name, b in best.items():
        s = b["summary"]
        per_round = ", ".join(f"{x['summary']['output_tok_s']:.1f}" for x in rounds[name])
        lines.append(f"| {name} | {s['output_tok_s']:.2f} | {report['ratios'][name]:.2f} | "
                     f"{s['tpot_p50_s'] * 1e3:.0f} | {s['ttft_p50_s']:.2f} | {b['cpu_s']:.1f} | "
                     f"{per_round} |")
    suffix = "" if args.preset == "full" else f"_{args.preset}"
    save_table(report, args.out / f"omp_policy{suffix}", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
