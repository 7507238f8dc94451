"""Speculative decoding without a draft model: output tok/s and accepted tokens per step,
speculation off against on (`lookup`, `tree`), at batch 1, 8 and 64, on four chat workloads
(`bench/chat_workloads.py`: agent, extraction, repeated_question, control). Issue 29's figures.

    python bench/speculative.py --preset quick                 # 16 minutes here (load 1.5-3)
    python bench/speculative.py --preset full
    python bench/speculative.py --preset quick --modes off     # the harness alone

One in-process Engine per mode (`EngineConfig.speculative`, what a deployment picks),
all loaded at once. Each row (workload x batch) runs the same requests once per mode,
modes in turn and the order reversed each round (off lookup tree, tree lookup off, ...),
so a drift in the machine's load falls on every mode alike; each run starts with its
engine's cache flushed. Batch = requests in flight: `batch` threads, each running one
conversation's turns in order, then taking the next conversation (a closed loop).

Repeated questions are asked once each before the timed run (untimed, the deployment's
history: `split_history`), so every timed asking has an earlier answer in the tree.

Greedy decoding with the model's end of turn honoured (at most `output_tokens`): greedy
speculation must not change a token, so every mode's outputs are compared with off's,
request by request, and the mismatches counted. Accepted tokens per step is the engine's
`spec_accepted_tokens / spec_steps` (steps of a sequence that drafted); a step that emits
the accepted run plus its own token emits 1 + that many.

Writes `bench/results/speculative_<preset>.{json,md,png}` with the commit and the
machine's measured limits.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/speculative.py`: make `bench` importable
    sys.path.append(str(Path(__file__).resolve().parent.parent))

import torch

from bench.chat_workloads import CHAT_WORKLOADS, make_chat_workload, split_history
from bench.concurrency import closed_loop
from bench.machine import measure_limits, names_of, start_model_run
from bench.metrics import RequestRecord, summarize
from bench.report import pyplot, save_figure, save_table
from bench.workloads import IM_END, Request, Workload

MODES = ("off", "lookup", "tree")
PRESETS: dict[str, dict[str, Any]] = {
    # conversations: per batch size, how many conversations (askings) a run has.
    "tiny": dict(batches=(1, 2), conversations={1: 1, 2: 2}, rounds=1),
    "quick": dict(batches=(1, 8, 64), conversations={1: 2, 8: 8, 64: 64}, rounds=1),
    "full": dict(batches=(1, 8, 64), conversations={1: 4, 8: 16, 64: 128}, rounds=2),
}
COUNTERS = ("steps", "decode_tokens", "prefill_tokens", "retractions", "prompt_tokens",
            "prompt_cached_tokens", "spec_steps", "spec_draft_tokens", "spec_accepted_tokens")
"""Engine stats counters read before and after each run (absent ones read as 0)."""
TARGETS = (("agent", 1, ">=", 2.0), ("repeated_question", 1, ">=", 2.0),
           *(("control", b, ">=", 0.97) for b in (1, 8, 64)))
"""Issue 29's targets: (workload, batch, op, bound) on a mode's output tok/s over off's."""


class ModeRun:
    """One run of a workload on one engine: `conversation` runs one conversation's turns
    in order (the closed loop calls it from `batch` threads at once) and keeps what each
    request got."""

    def __init__(self, engine: Any, workload: Workload, end_of_turn: list[int]) -> None:
        self.engine, self.workload, self.end_of_turn = engine, workload, end_of_turn
        self.prompts: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.history: dict[str, list[int]] = {}
        """Outputs as the next turn's prompt holds them: without the end-of-turn token,
        which the next segment writes itself."""
        self.records: list[RequestRecord] = []
        self.spec: dict[str, tuple[int, int]] = {}
        """Per request, its `meta_info` (spec_draft_tokens, spec_accepted_tokens)."""
        self._lock = threading.Lock()

    def conversation(self, chain: list[Request]) -> None:
        for req in chain:
            with self._lock:
                prompt = self.workload.prompt(req, self.prompts, self.history)
            params = {"max_new_tokens": req.output_tokens, "temperature": 0.0}
            submitted = time.perf_counter()
            res = self.engine.generate(input_ids=prompt, sampling_params=params)
            meta, out = res["meta_info"], list(res["output_ids"])
            end = len(self.end_of_turn)
            history = out[:-end] if out[-end:] == self.end_of_turn else out
            with self._lock:
                self.prompts[req.rid], self.outputs[req.rid] = prompt, out
                self.history[req.rid] = history
                self.spec[req.rid] = (meta.get("spec_draft_tokens", 0),
                                      meta.get("spec_accepted_tokens", 0))
                self.records.append(RequestRecord(
                    req.rid, req.group, req.turn, len(prompt), meta["cached_tokens"], len(out),
                    submitted, submitted + meta["ttft"], submitted + meta["e2e_latency"]))


def conversations(workload: Workload) -> list[list[Request]]:
    """The workload's requests grouped into conversations (a root and its descendants,
    in turn order), in the order their first requests arrive."""
    chains: dict[str, list[Request]] = {}
    root: dict[str, str] = {}
    for req in workload.requests:
        root[req.rid] = req.rid if req.parent is None else root[req.parent]
        chains.setdefault(root[req.rid], []).append(req)
    return list(chains.values())


def run_mode(engine: Any, workload: Workload, batch: int, end_of_turn: list[int]) -> dict:
    """`workload` on `engine` from a flushed cache, `batch` conversations in flight: the
    summary, the engine's counters over the timed run, and every output. Its history
    (`split_history`) runs first, untimed, as the deployment's past."""
    engine.flush_cache()
    history, timed = split_history(workload)
    outputs: dict[str, list[int]] = {}
    if history is not None:
        past = ModeRun(engine, history, end_of_turn)
        closed_loop(past.conversation, conversations(history), batch)
        outputs.update(past.outputs)
    before = engine.stats()
    run = ModeRun(engine, timed, end_of_turn)
    cpu, start = time.process_time(), time.perf_counter()
    closed_loop(run.conversation, conversations(timed), batch)
    cpu = time.process_time() - cpu
    after = engine.stats()
    outputs.update(run.outputs)
    records = [RequestRecord(r.rid, r.group, r.turn, r.prompt_tokens, r.cached_tokens,
                             r.output_tokens, r.submit_s - start, r.first_token_s - start,
                             r.finish_s - start) for r in run.records]
    counters = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}
    return {"summary": summarize(records), "counters": counters, "cpu_s": cpu,
            "meta_spec_draft_tokens": sum(d for d, _ in run.spec.values()),
            "meta_spec_accepted_tokens": sum(a for _, a in run.spec.values()),
            "loadavg_1m_after": os.getloadavg()[0], "outputs": outputs}


def mismatches(outputs: dict[str, list[int]], reference: dict[str, list[int]]) -> dict:
    """Requests whose output differs from the reference's, with where each first differs."""
    diverge = {}
    for rid, ref in reference.items():
        out = outputs.get(rid)
        if out != ref:
            out = out or []
            diverge[rid] = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b),
                                min(len(out), len(ref)))
    return {"count": len(diverge), "requests": len(reference), "first_diverging": diverge}


def run_row(engines: dict[str, Any], workload: Workload, batch: int, rounds: int,
            end_of_turn: list[int]) -> dict[str, Any]:
    """Every mode on the same requests, interleaved over `rounds` (order reversed each
    round); per mode the totals over its rounds, and its outputs against off's."""
    modes = list(engines)
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            result = run_mode(engines[mode], workload, batch, end_of_turn)
            runs[mode].append(result)
            s = result["summary"]
            print(f"  {workload.name:<18} batch {batch:>3} {mode:<7} {s['output_tok_s']:8.2f} "
                  f"out tok/s  wall {s['wall_s']:6.1f} s  "
                  f"accepted/step {_per_step(result['counters']):.2f}", flush=True)
    history, timed = split_history(workload)
    row: dict[str, Any] = {"workload": workload.name, "batch": batch,
                           "settings": dict(workload.settings), "requests": timed.num_requests,
                           "history_requests": 0 if history is None else history.num_requests,
                           "modes": {}}
    reference = runs["off"][0]["outputs"] if "off" in runs else None
    for mode, results in runs.items():
        tokens = sum(x["summary"]["output_tokens"] for x in results)
        wall = sum(x["summary"]["wall_s"] for x in results)
        cpu = sum(x["cpu_s"] for x in results)
        counters = {k: sum(x["counters"][k] for x in results) for k in COUNTERS}
        row["modes"][mode] = {
            "output_tok_s": tokens / wall, "output_tokens": tokens, "wall_s": wall,
            "output_tok_per_cpu_s": tokens / cpu, "cpu_s": cpu,
            "rounds_output_tok_s": [x["summary"]["output_tok_s"] for x in results],
            "accepted_per_step": _per_step(counters),
            "acceptance": (counters["spec_accepted_tokens"] / counters["spec_draft_tokens"]
                           if counters["spec_draft_tokens"] else None),
            "counters": counters,
            "meta_spec_draft_tokens": sum(x["meta_spec_draft_tokens"] for x in results),
            "meta_spec_accepted_tokens": sum(x["meta_spec_accepted_tokens"] for x in results),
            "loadavg_1m_after": [x["loadavg_1m_after"] for x in results],
            "summary": results[0]["summary"],
            "mismatches": (None if reference is None else
                           _merge([mismatches(x["outputs"], reference) for x in results])),
        }
    off = row["modes"].get("off")
    for entry in row["modes"].values():
        entry["ratio"] = entry["output_tok_s"] / off["output_tok_s"] if off else None
        entry["cpu_ratio"] = (entry["output_tok_per_cpu_s"] / off["output_tok_per_cpu_s"]
                              if off else None)
    return row


def _per_step(counters: dict[str, int]) -> float:
    steps = counters["spec_steps"]
    return counters["spec_accepted_tokens"] / steps if steps else 0.0


def _merge(results: list[dict]) -> dict:
    """Mismatches over rounds: the worst round's count, every diverging request."""
    worst = max(results, key=lambda m: m["count"])
    return {**worst, "rounds": [m["count"] for m in results]}


def targets(rows: list[dict]) -> list[dict[str, Any]]:
    """Issue 29's targets, per speculating mode, where the rows have the numbers."""
    out = []
    for workload, batch, op, bound in TARGETS:
        for row in rows:
            if row["workload"] != workload or row["batch"] != batch:
                continue
            for mode, entry in row["modes"].items():
                if mode != "off" and entry["ratio"] is not None:
                    out.append({"target": f"{workload} batch {batch}: {mode} / off output tok/s",
                                "value": entry["ratio"], "bound": f"{op} {bound:g}",
                                "met": entry["ratio"] >= bound})
    return out


def _rows(counters: dict[str, int]) -> int:
    """Query rows the engine ran: prompt tokens, one per decoding sequence-step, and the
    drafts (`decode_tokens` counts accepted drafts as decoded tokens too)."""
    c = counters
    return (c["prefill_tokens"] + c["decode_tokens"] - c["spec_accepted_tokens"]
            + c["spec_draft_tokens"])


def markdown(report: dict[str, Any]) -> str:
    m, lim = report["machine"], report["limits"]
    modes = report["settings"]["modes"]
    lines = [f"# Speculative decoding without a draft model: preset `{report['preset']}`", "",
             f"Commit `{m['commit']}` (radixserve imported at `{m['radixserve_commit']}`), "
             f"{m['cpu']}, {m['cores']} cores, torch threads {m['torch_threads']}, load "
             f"average at start {m['loadavg_at_start'][0]:.2f}; torch {m['torch']}. Model "
             f"`{report['settings']['model']}`, float32, greedy, end of turn honoured "
             f"(at most the preset's output tokens). Measured limits (same run): fp32 "
             f"matmul **{lim['matmul_gflops']:.1f} GFLOP/s**, memory read "
             f"**{lim['read_gbs']:.1f} GB/s**.", "",
             f"One engine per mode ({', '.join(modes)}), "
             f"`speculative_num_draft_tokens={report['settings']['num_draft_tokens']}`; each "
             f"row runs every mode on the same requests in turn ({report['settings']['rounds']} "
             "round(s), order reversed each round), each from a flushed cache. Batch = "
             "conversations in flight (closed loop). Requests: timed requests (repeated "
             "questions were each asked once before, untimed: the deployment's history). "
             "x off: output tok/s over off's in the same row; x off CPU: the same per "
             "CPU-second of this process (a check: it tracks the work done when other jobs "
             "take the cores, which wall time does not). Accepted/step: accepted draft "
             "tokens per speculating sequence-step (engine counters). Steps and rows: the "
             "engine's forward steps and the query rows they ran (prompt, decode and draft "
             "tokens), exact where the machine's load blurs the times. Mismatches: requests "
             "whose greedy output differs from off's.", "",
             "| workload | batch | requests | mode | out tok/s | x off | x off CPU "
             "| steps | rows | accepted/step | acceptance | mean out tokens | mismatches "
             "| load 1m |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        for mode, e in row["modes"].items():
            mis, c = e["mismatches"], e["counters"]
            mis_s = "-" if mode == "off" or mis is None else f"{mis['count']}/{mis['requests']}"
            lines.append(
                f"| {row['workload']} | {row['batch']} | {row['requests']} | {mode} | "
                f"{e['output_tok_s']:.2f} | {_f(e['ratio'])} | {_f(e['cpu_ratio'])} | "
                f"{c['steps']} | {_rows(c)} | "
                f"{'-' if mode == 'off' else _f(e['accepted_per_step'])} | "
                f"{_f(e['acceptance'])} | {e['summary']['output_tokens'] / row['requests']:.0f} | "
                f"{mis_s} | {max(e['loadavg_1m_after']):.1f} |")
    lines += ["", "Workload settings: " + "; ".join(
        f"{w}: " + ", ".join(f"{k}={v}" for k, v in s.items() if k != "conversations")
        for w, s in report["workload_settings"].items()), ""]
    if report["targets"]:
        lines += ["| target | value | bound | met |", "|---|---|---|---|"]
        lines += [f"| {t['target']} | {t['value']:.2f} | {t['bound']} | "
                  f"{'yes' if t['met'] else '**no**'} |" for t in report["targets"]]
    return "\n".join(lines) + "\n"


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def plot(report: dict[str, Any], path: Path) -> None:
    """Output tok/s over off's, per workload (panels) and batch (x), one line per mode."""
    plt = pyplot()

    workloads = list(dict.fromkeys(r["workload"] for r in report["rows"]))
    fig, axes = plt.subplots(1, len(workloads), figsize=(3.2 * len(workloads), 3.2),
                             squeeze=False, sharey=True)
    for ax, workload in zip(axes[0], workloads):
        rows = [r for r in report["rows"] if r["workload"] == workload]
        for i, mode in enumerate(m for m in report["settings"]["modes"] if m != "off"):
            ax.plot([str(r["batch"]) for r in rows], [r["modes"][mode]["ratio"] for r in rows],
                    marker="o", color=f"C{i}", label=mode)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_title(workload, fontsize=9)
        ax.set_xlabel("batch (in flight)")
    axes[0][0].set_ylabel("output tok/s, on / off")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Speculative decoding ({report['preset']}, {report['machine']['commit']})",
                 fontsize=10)
    save_figure(fig, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    p.add_argument("--modes", type=names_of(MODES), default=list(MODES),
                   help="comma-separated engines' `speculative` settings; off is the baseline")
    p.add_argument("--workloads", type=names_of(CHAT_WORKLOADS), default=list(CHAT_WORKLOADS))
    p.add_argument("--batches", default=None, help="comma-separated (default: the preset's)")
    p.add_argument("--num-draft-tokens", type=int, default=4,
                   help="speculative_num_draft_tokens of the speculating engines")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-total-tokens", type=int, default=32768,
                   help="each engine's KV pool (tokens)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    preset = PRESETS[args.preset]
    args.batches = ([int(b) for b in args.batches.split(",")] if args.batches
                    else list(preset["batches"]))
    for b in args.batches:
        if b not in preset["conversations"]:
            p.error(f"batch {b} has no size in preset {args.preset}: "
                    f"{', '.join(map(str, preset['conversations']))}")
    return args


def engine_options(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """An engine's options for `mode`: off passes none of speculation's (so the harness
    runs on an engine that predates them)."""
    options: dict[str, Any] = {"max_total_tokens": args.max_total_tokens}
    if mode != "off":
        options.update(speculative=mode, speculative_num_draft_tokens=args.num_draft_tokens)
    return options


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from radixserve import Engine

    run = start_model_run(args.model, args.threads, quick_limits=args.preset == "tiny")
    model_dir, encode = run.model_dir, run.encode
    end_of_turn = encode(IM_END)
    preset = PRESETS[args.preset]
    engines = {m: Engine(str(model_dir), **engine_options(m, args)) for m in args.modes}
    rows: list[dict] = []
    settings: dict[str, dict] = {}
    try:
        for engine in engines.values():  # warm-up, not timed
            engine.generate(input_ids=list(range(100, 140)),
                            sampling_params={"max_new_tokens": 4, "temperature": 0.0})
        for name in args.workloads:
            for batch in args.batches:
                workload = make_chat_workload(name, args.preset, encode,
                                              preset["conversations"][batch], seed=args.seed)
                settings[name] = dict(workload.settings)
                rows.append(run_row(engines, workload, batch, preset["rounds"], end_of_turn))
    finally:
        for engine in engines.values():
            engine.shutdown()
    report = {
        "preset": args.preset, "machine": run.machine, "limits": run.limits,
        "limits_end": measure_limits(quick=args.preset == "tiny"),
        "settings": {"model": args.model, "modes": args.modes, "batches": args.batches,
                     "num_draft_tokens": args.num_draft_tokens, "rounds": preset["rounds"],
                     "seed": args.seed, "threads": torch.get_num_threads(),
                     "max_total_tokens": args.max_total_tokens, "argv": sys.argv[1:]},
        "workload_settings": settings, "rows": rows, "targets": targets(rows),
        "elapsed_s": time.perf_counter() - run.started, "loadavg_at_end": os.getloadavg(),
    }
    stem = args.out / f"speculative_{args.preset}"
    save_table(report, stem, markdown(report))
    if any(m != "off" for m in args.modes):
        plot(report, stem.with_suffix(".png"))
    return report


if __name__ == "__main__":
    main()
