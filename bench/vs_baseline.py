"""This checkout against an earlier commit of radixserve, in one run, on one workload.

    python bench/vs_baseline.py --baseline 492c3ff              # the issue-10 workload
    python bench/vs_baseline.py --baseline 492c3ff --rounds 3 --workload-opt output_tokens=64

The baseline commit is checked out (once) into a git worktree under `--workdir`; each
round runs `bench/run.py` (this checkout's harness) with the radixserve runner twice, once
importing the baseline's package and once this checkout's, alternating, so both see the
same machine. The best round of each counts. The default workload is issue 10's: 64
requests in 8 groups, ~1,034-token prompts of which 998 are shared, 32 new tokens, greedy.
Writes `bench/results/vs_baseline_<commit>.{json,md}`.
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

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import git_commit, machine_info, measure_limits
from bench.report import save_table

ROOT = Path(__file__).resolve().parent.parent
ISSUE_10_WORKLOAD = ["groups=8", "per_group=8", "system_tokens=998", "question_tokens=36",
                     "output_tokens=32"]


def baseline_checkout(commit: str, workdir: Path) -> Path:
    """A worktree of `commit`, importable as `radixserve` from its root. The package's
    `kernels` subpackage lives at the repository's top (an install-time mapping), so a
    link puts it where a plain import looks."""
    path = workdir / f"radixserve-{commit}"
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), commit], cwd=ROOT,
                       check=True, capture_output=True)
    link = path / "radixserve" / "kernels"
    if not link.exists():
        link.symlink_to(path / "kernels", target_is_directory=True)
    return path


def run_once(checkout: Path, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, str(ROOT / "bench" / "run.py"), "--preset", "full",
           "--workloads", "shared_prefix", "--runners", "radixserve", "--no-probes",
           "--out", str(out)]
    for opt in args.workload_opt:
        cmd += ["--workload-opt", opt]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    subprocess.run(cmd, env=env, check=True)
    report = json.loads((out / "full_shared_prefix.json").read_text())
    imported = report["machine"]["radixserve_path"]
    if Path(imported).resolve() != (checkout / "radixserve").resolve():
        raise RuntimeError(f"run meant for {checkout} imported radixserve from {imported}")
    run = report["workloads"]["shared_prefix"]["runs"]["radixserve"]
    return {"commit": report["machine"]["radixserve_commit"], "summary": run["summary"],
            "info": run["info"], "cpu_s": run["cpu_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="commit to compare against")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--workload-opt", action="append", default=None, metavar="KEY=VALUE",
                   help=f"shared_prefix settings (default: {' '.join(ISSUE_10_WORKLOAD)})")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args()
    args.workload_opt = args.workload_opt or ISSUE_10_WORKLOAD
    checkouts = {"baseline": baseline_checkout(args.baseline, args.workdir), "this": ROOT}
    limits = measure_limits()
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in checkouts}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, checkout in checkouts.items():
                rounds[name].append(run_once(checkout, args, Path(tmp) / f"{name}{r}"))
                print(f"round {r} {name}: {rounds[name][-1]['summary']['output_tok_s']:.2f} "
                      "out tok/s", flush=True)
    best = {name: max(rs, key=lambda x: x["summary"]["output_tok_s"]) for name, rs in rounds.items()}
    ratio = best["this"]["summary"]["output_tok_s"] / best["baseline"]["summary"]["output_tok_s"]
    report = {"baseline": args.baseline, "this": git_commit(ROOT), "workload": args.workload_opt,
              "machine": machine_info(), "limits": limits, "rounds": rounds, "ratio": ratio}
    m = report["machine"]
    lines = [f"# radixserve `{report['this']}` against `{best['baseline']['commit']}`", "",
             f"{m['cpu']}, {m['cores']} cores, torch threads {m['torch_threads']}; measured "
             f"fp32 matmul {limits['matmul_gflops']:.1f} GFLOP/s, read {limits['read_gbs']:.1f} "
             f"GB/s. Workload shared_prefix ({', '.join(args.workload_opt)}), greedy, EOS "
             f"ignored; {args.rounds} alternating rounds, best of each.", "",
             "| radixserve | out tok/s | TTFT p50 s | TPOT p50 ms | cache hit | wall s | CPU s "
             "| rounds out tok/s |", "|---|---|---|---|---|---|---|---|"]
    for name in checkouts:
        s = best[name]["summary"]
        per_round = ", ".join(f"{x['summary']['output_tok_s']:.1f}" for x in rounds[name])
        lines.append(f"| {name} `{best[name]['commit']}` | {s['output_tok_s']:.2f} | "
                     f"{s['ttft_p50_s']:.2f} | {s['tpot_p50_s'] * 1e3:.0f} | "
                     f"{s['cache_hit_rate']:.0%} | {s['wall_s']:.1f} | {best[name]['cpu_s']:.1f} | "
                     f"{per_round} |")
    lines += ["", f"This checkout / baseline: **{ratio:.2f}x** output tokens per second."]
    save_table(report, args.out / f"vs_baseline_{args.baseline}", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
