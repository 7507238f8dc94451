"""The baseline-by-commit peer: this checkout against an earlier commit of radixserve, in one
run (`python bench/run.py --baseline COMMIT`).

    python bench/run.py --baseline 492c3ff --preset full --workloads shared_prefix  # issue 10
    python bench/run.py --baseline f6e0644 --preset quick \
        --workloads shared_prefix,multi_turn,agent,no_sharing       # "no change in speed"

The baseline commit is checked out (once) into a git worktree under `--workdir`; each
round runs `bench/run.py` (this checkout's harness) with the radixserve runner twice, once
importing the baseline's package and once this checkout's, alternating, so both see the
same machine. The best round of each counts, per workload. With `--preset full
--workloads shared_prefix` and no `--workload-opt` it is issue 10's workload: 64 requests
in 8 groups, ~1,034-token prompts of which 998 are shared, 32 new tokens, greedy. Writes
`bench/results/vs_baseline_<commit>[_<preset>].{json,md}`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.machine import git_commit, machine_info, measure_limits
from bench.report import save_table

ROOT = Path(__file__).resolve().parent.parent
ISSUE_10_WORKLOAD = ["groups=8", "per_group=8", "system_tokens=998", "question_tokens=36",
                     "output_tokens=32"]


def baseline_checkout(commit: str, workdir: Path) -> Path:
    """A worktree of `commit`, importable as `radixserve` from its root. Before 6a24ceb the
    package's `kernels` and `router` subpackages lived at the repository's top (an
    install-time mapping), so a link puts them where a plain import looks."""
    path = workdir / f"radixserve-{commit}"
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), commit], cwd=ROOT,
                       check=True, capture_output=True)
    for sub in ("kernels", "router"):
        link = path / "radixserve" / sub
        if (path / sub).is_dir() and not link.exists():
            link.symlink_to(path / sub, target_is_directory=True)
    return path


def harness_path(workdir: Path) -> Path:
    """A folder holding only a link to this checkout's bench/: first on the runs'
    PYTHONPATH, so a baseline's run imports this harness, not the baseline's own bench/
    (which a plain checkout first on the path would shadow it with)."""
    shim = workdir / "radixserve-bench-harness"
    shim.mkdir(exist_ok=True)
    if not (shim / "bench").exists():
        (shim / "bench").symlink_to(ROOT / "bench", target_is_directory=True)
    return shim


def run_once(checkout: Path, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One run of the workloads through `checkout`: per workload, its radixserve summary."""
    cmd = [sys.executable, str(ROOT / "bench" / "run.py"), "--preset", args.preset,
           "--workloads", ",".join(args.workloads), "--runners", "radixserve", "--no-probes",
           "--out", str(out)]
    for opt in args.workload_opt:
        cmd += ["--workload-opt", opt]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    pythonpath = f"{harness_path(args.workdir)}{os.pathsep}{checkout}"
    subprocess.run(cmd, env={**os.environ, "PYTHONPATH": pythonpath}, check=True)
    (path,) = out.glob(f"{args.preset}*.json")
    report = json.loads(path.read_text())
    imported = report["machine"]["radixserve_path"]
    if Path(imported).resolve() != (checkout / "radixserve").resolve():
        raise RuntimeError(f"run meant for {checkout} imported radixserve from {imported}")
    runs = {w: report["workloads"][w]["runs"]["radixserve"] for w in args.workloads}
    return {"commit": report["machine"]["radixserve_commit"],
            "workloads": {w: {"summary": r["summary"], "info": r["info"], "cpu_s": r["cpu_s"]}
                          for w, r in runs.items()}}


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """`args` as bench/run.py parses them (`--baseline`, `--rounds`, `--workdir`, the
    preset, workloads, threads and workload options): the report, also written."""
    issue_10 = args.preset == "full" and args.workloads == ["shared_prefix"]
    args.workload_opt = args.workload_opt or (ISSUE_10_WORKLOAD if issue_10 else [])
    checkouts = {"baseline": baseline_checkout(args.baseline, args.workdir), "this": ROOT}
    limits = measure_limits()
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in checkouts}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, checkout in checkouts.items():
                rounds[name].append(run_once(checkout, args, Path(tmp) / f"{name}{r}"))
                print(f"round {r} {name}: " + ", ".join(
                    f"{w} {x['summary']['output_tok_s']:.2f}"
                    for w, x in rounds[name][-1]["workloads"].items()) + " out tok/s", flush=True)

    def best(name: str, w: str) -> dict[str, Any]:
        return max((x["workloads"][w] | {"commit": x["commit"]} for x in rounds[name]),
                   key=lambda x: x["summary"]["output_tok_s"])

    ratios = {w: best("this", w)["summary"]["output_tok_s"]
              / best("baseline", w)["summary"]["output_tok_s"] for w in args.workloads}
    report = {"baseline": args.baseline, "this": git_commit(ROOT), "preset": args.preset,
              "workload_opt": args.workload_opt, "machine": machine_info(), "limits": limits,
              "rounds": rounds, "ratios": ratios}
    m = report["machine"]
    opts = f" ({', '.join(args.workload_opt)})" if args.workload_opt else ""
    lines = [f"# radixserve `{report['this']}` against `{args.baseline}`", "",
             f"{m['cpu']}, {m['cores']} cores, torch threads {m['torch_threads']}; measured "
             f"fp32 matmul {limits['matmul_gflops']:.1f} GFLOP/s, read {limits['read_gbs']:.1f} "
             f"GB/s. Preset {args.preset}{opts}, greedy, EOS ignored; {args.rounds} "
             "alternating rounds, best of each.", "",
             "| workload | radixserve | out tok/s | TTFT p50 s | TPOT p50 ms | cache hit | wall s "
             "| CPU s | rounds out tok/s |", "|---|---|---|---|---|---|---|---|---|"]
    for w in args.workloads:
        for name in checkouts:
            b = best(name, w)
            s = b["summary"]
            per_round = ", ".join(f"{x['workloads'][w]['summary']['output_tok_s']:.1f}"
                                  for x in rounds[name])
            lines.append(f"| {w} | {name} `{b['commit']}` | {s['output_tok_s']:.2f} | "
                         f"{s['ttft_p50_s']:.2f} | {s['tpot_p50_s'] * 1e3:.0f} | "
                         f"{s['cache_hit_rate']:.0%} | {s['wall_s']:.1f} | {b['cpu_s']:.1f} | "
                         f"{per_round} |")
    lines += [""] + [f"{w}: this checkout / baseline **{ratios[w]:.2f}x** output tokens per "
                     "second." for w in args.workloads]
    suffix = "" if issue_10 else f"_{args.preset}"
    save_table(report, args.out / f"vs_baseline_{args.baseline}{suffix}", "\n".join(lines) + "\n")
    return report
