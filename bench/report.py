"""A run's report: one JSON document, a markdown table, and matplotlib PNG plots.

The JSON holds everything (settings, machine, limits, probes, per-request records); the
markdown and the plots are derived from it alone, so they can be redrawn from a saved file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from bench.metrics import RequestRecord, agreement, hit_rate_over_time, summarize
from bench.runners.base import RunResult

REFERENCE_RUNNER = "radixserve"
"""Other runners' outputs are compared with this one's (greedy: they should be equal)."""
RUNNER_ORDER = ("radixserve", "radixserve-rpc", "radixserve-nocache", "hf-generate",
                "hf-prefix-reuse")
"""Plot order and colours (tab10 index); runners not listed follow."""


def run_entry(result: RunResult, reference: RunResult | None) -> dict[str, Any]:
    return {
        "summary": summarize(result.records),
        "peak_rss_mb": result.peak_rss_mb,
        "cpu_s": result.cpu_s,
        "info": result.info,
        "agreement": (agreement(result.outputs, reference.outputs)
                      if reference is not None and reference is not result else None),
        "hit_rate_over_time": hit_rate_over_time(result.records),
        "records": [r.to_dict() for r in result.records],
    }


def _ratio(report: dict, workload: str, a: str, b: str, cpu: bool = False) -> float | None:
    """Output tokens per second of runner a over runner b; with `cpu`, per CPU-second."""
    runs = report["workloads"].get(workload, {}).get("runs", {})
    if a not in runs or b not in runs:
        return None
    if cpu:
        if not runs[a].get("cpu_s") or not runs[b].get("cpu_s"):
            return None
        rate = lambda r: r["summary"]["output_tokens"] / r["cpu_s"]  # noqa: E731
    else:
        rate = lambda r: r["summary"]["output_tok_s"]  # noqa: E731
    return rate(runs[a]) / rate(runs[b])


def targets(report: dict) -> list[dict[str, Any]]:
    """The issue's targets that this report has the numbers for."""
    out = []

    def add(name: str, value: float | None, op: str, bound: float) -> None:
        if value is not None:
            met = value >= bound if op == ">=" else value <= bound
            out.append({"target": name, "value": value, "bound": f"{op} {bound:g}", "met": met})

    for workload, a, b, bound in (("shared_prefix", "radixserve", "hf-generate", 6),
                                  ("shared_prefix", "radixserve", "hf-prefix-reuse", 3),
                                  ("shared_prefix", "radixserve", "radixserve-nocache", 4),
                                  ("no_sharing", "radixserve", "radixserve-nocache", 0.95)):
        add(f"{workload}: {a} / {b} output tok/s", _ratio(report, workload, a, b), ">=", bound)
        add(f"{workload}: {a} / {b} output tokens per CPU-second (check)",
            _ratio(report, workload, a, b, cpu=True), ">=", bound)
    probes = report.get("probes") or {}
    if "prefill" in probes:
        add("prefill: fraction of fp32 matmul rate", probes["prefill"]["fraction_of_matmul"],
            ">=", 0.5)
    if "decode" in probes:
        add("decode batch 1: fraction of weight-read bandwidth limit",
            probes["decode"]["fraction_of_bandwidth"], ">=", 0.75)
    if "ttft_cached" in probes:
        add("TTFT cached / cold", probes["ttft_cached"]["ratio"], "<=", 0.15)
    return out


def _f(x: float | None, digits: int = 2, scale: float = 1.0) -> str:
    return "-" if x is None or math.isnan(x) else f"{x * scale:.{digits}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.0%}"


def markdown(report: dict) -> str:
    m, lim = report["machine"], report.get("limits") or {}
    engine = m.get("radixserve_commit", m["commit"])
    lines = [f"# radixserve benchmarks: preset `{report['preset']}`", "",
             f"Commit `{m['commit']}` (radixserve imported at `{engine}`), {m['cpu']}, "
             f"{m['cores']} cores, torch threads "
             f"{m['torch_threads']}, load average at start {m['loadavg_at_start'][0]:.2f}; "
             f"torch {m['torch']}, transformers {m['transformers']}. Model "
             f"`{report['settings']['model']}`, float32, greedy, EOS ignored.", "",
             "CPU s: this process's CPU time during the run (all threads); with one torch "
             "thread it tracks the work done even when other jobs take the cores, which wall "
             "time does not. Load 1m: the 1-minute load average after the run (this run "
             "itself adds about 1). Same output: share of requests whose greedy output equals "
             "radixserve's.", ""]
    if lim:
        lines += ["Measured limits (same run): "
                  f"fp32 matmul **{lim['matmul_gflops']:.1f} GFLOP/s**, "
                  f"memory read **{lim['read_gbs']:.1f} GB/s**, copy {lim['copy_gbs']:.1f} GB/s "
                  "(read + write).", ""]
    lines += ["| workload | runner | out tok/s | total tok/s | req/s | TTFT p50 s | TTFT p99 s "
              "| TPOT p50 ms | TPOT p99 ms | cache hit | peak RSS MiB | wall s | CPU s | load 1m "
              "| same output |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for wname, w in report["workloads"].items():
        for rname, run in w["runs"].items():
            s = run["summary"]
            lines.append(
                f"| {wname} | {rname} | {_f(s['output_tok_s'])} | {_f(s['total_tok_s'], 1)} | "
                f"{_f(s['requests_s'], 3)} | {_f(s['ttft_p50_s'])} | {_f(s['ttft_p99_s'])} | "
                f"{_f(s['tpot_p50_s'], 0, 1e3)} | {_f(s['tpot_p99_s'], 0, 1e3)} | "
                f"{_pct(s['cache_hit_rate'])} | {run['peak_rss_mb']:.0f} | {_f(s['wall_s'], 1)} | "
                f"{_f(run.get('cpu_s'), 1)} | {_f(run.get('loadavg_1m_after'), 1)} | "
                f"{_pct(run['agreement'])} |")
    lines += ["", "Workload settings:", ""]
    for wname, w in report["workloads"].items():
        best_of = (f" (best of {w['repeats']} interleaved rounds per runner)"
                   if w.get("repeats", 1) > 1 else "")
        lines.append(f"- {wname}: " + ", ".join(f"{k}={v}" for k, v in w["settings"].items())
                     + best_of)
    probes = report.get("probes") or {}
    if probes:
        lines += ["", "Engine probes (single requests):", ""]
        if "prefill" in probes:
            p = probes["prefill"]
            lines.append(f"- prefill {p['prompt_tokens']} tokens: {p['tokens_per_s']:.0f} tok/s, "
                         f"{p['gflops']:.1f} GFLOP/s = {p['fraction_of_matmul']:.0%} of matmul")
        if "decode" in probes:
            d = probes["decode"]
            lines.append(f"- decode batch 1: {min(d['step_s']) * 1e3:.1f} ms/step, floor "
                         f"{d['floor_s'] * 1e3:.1f} ms ({d['bytes_per_step'] / 1e6:.0f} MB), "
                         f"{d['achieved_gbs']:.1f} GB/s = {d['fraction_of_bandwidth']:.0%} of "
                         "read bandwidth")
        if "ttft_cached" in probes:
            t = probes["ttft_cached"]
            lines.append(f"- TTFT with a {t['system_tokens']}-token system prompt cached: "
                         f"{t['cached_s']:.3f} s vs {t['cold_s']:.3f} s cold = {t['ratio']:.3f}x")
    checks = report.get("targets") or []
    if checks:
        lines += ["", "| target | value | bound | met |", "|---|---|---|---|"]
        lines += [f"| {c['target']} | {c['value']:.3f} | {c['bound']} | "
                  f"{'yes' if c['met'] else '**no**'} |" for c in checks]
    return "\n".join(lines) + "\n"


def plot(report: dict, stem: Path) -> list[Path]:
    """throughput by runner per workload, TTFT distributions, cache hit rate over time."""
    plt = pyplot()

    workloads = list(report["workloads"])
    present = {r for w in report["workloads"].values() for r in w["runs"]}
    order = [*RUNNER_ORDER, *sorted(present - set(RUNNER_ORDER))]
    runners = [r for r in order if r in present]
    color = {r: f"C{order.index(r) % 10}" for r in runners}
    paths = []

    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(workloads)), 4))
    width = 0.8 / max(len(runners), 1)
    for i, rname in enumerate(runners):
        ys = [report["workloads"][w]["runs"].get(rname, {}).get("summary", {})
              .get("output_tok_s", 0.0) for w in workloads]
        ax.bar([x + i * width for x in range(len(workloads))], ys, width, label=rname,
               color=color[rname])
    ax.set_xticks([x + width * (len(runners) - 1) / 2 for x in range(len(workloads))], workloads)
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Throughput by runner ({report['preset']})")
    ax.legend(fontsize=8)
    paths.append(save_figure(fig, stem.with_name(f"{stem.name}_throughput.png")))

    for kind, ylabel in (("ttft", "share of requests"), ("hit_rate", "cumulative cache hit rate")):
        fig, axes = plt.subplots(1, len(workloads), figsize=(3.2 * len(workloads), 3.2),
                                 squeeze=False)
        for ax, wname in zip(axes[0], workloads):
            runs = report["workloads"][wname]["runs"]
            for rname in (r for r in runners if r in runs):
                run = runs[rname]
                if kind == "ttft":
                    xs = sorted(RequestRecord(**r).ttft for r in run["records"])
                    ys = [(i + 1) / len(xs) for i in range(len(xs))]
                else:
                    xs = [t for t, _ in run["hit_rate_over_time"]]
                    ys = [h for _, h in run["hit_rate_over_time"]]
                ax.step(xs, ys, where="post", label=rname, color=color[rname], marker=".",
                        markersize=4)
            ax.set_title(wname, fontsize=9)
            ax.set_ylim(-0.03, 1.03)
            ax.set_xlabel("TTFT s" if kind == "ttft" else "time since start s")
        axes[0][0].set_ylabel(ylabel)
        axes[0][-1].legend(fontsize=7)
        paths.append(save_figure(fig, stem.with_name(f"{stem.name}_{kind}.png")))
    return paths


def pyplot() -> Any:
    """matplotlib's pyplot on its file-only backend (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    pyplot().close(fig)
    return path


def write(report: dict, stem: Path) -> list[Path]:
    """Write `<stem>.json`, `<stem>.md` and the PNGs; return the paths written."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    report["targets"] = targets(report)
    json_path, md_path = stem.with_suffix(".json"), stem.with_suffix(".md")
    json_path.write_text(json.dumps(_clean(report), indent=1, default=str, allow_nan=False))
    md_path.write_text(markdown(report))
    return [json_path, md_path, *plot(report, stem)]


def _clean(x: Any) -> Any:
    """NaN becomes null (strict JSON); tuples become lists."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def save_table(report: dict, stem: Path, md: str) -> None:
    """`<stem>.json` and `<stem>.md` for the one-table benchmarks; prints the table."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
    stem.with_suffix(".md").write_text(md)
    print(md)
