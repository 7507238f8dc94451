"""The shared-prefix workload through the RPC server versus the in-process Engine.

Both get the same prompts from `concurrency` client threads (each thread sends its next
request when the previous one returns), so the difference is the cost of the three
processes and the wire. Also reports the scheduler's own time per step against the step.

    python bench/rpc_vs_engine.py --preset quick
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python bench/<this>.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.concurrency import drive  # noqa: E402
from bench.report import save_table  # noqa: E402

PRESETS = {
    "quick": dict(groups=4, per_group=16, system_tokens=300, question_tokens=20, output_tokens=24),
    "full": dict(groups=8, per_group=32, system_tokens=1000, question_tokens=30, output_tokens=32),
}
"""Sizes of the shared-prefix workload (bench.workloads.shared_prefix) for this comparison."""


def run(generate, prompts: list[list[int]], output_tokens: int, concurrency: int) -> dict:
    """Send every prompt (greedy, EOS ignored) from `concurrency` threads."""
    params = {"max_new_tokens": output_tokens, "temperature": 0, "ignore_eos": True}

    def one(prompt: list[int]) -> tuple[float, int]:
        meta = generate(prompt, params)["meta_info"]
        return meta["ttft"], meta["completion_tokens"]

    return drive(one, prompts, concurrency)


def step_overhead(before: dict, after: dict) -> dict:
    steps = after["steps"] - before["steps"]
    sched = after["scheduler_seconds_total"] - before["scheduler_seconds_total"]
    forward = after["forward_seconds_total"] - before["forward_seconds_total"]
    return {"steps": steps, "scheduler_ms_per_step": 1000 * sched / steps,
            "forward_ms_per_step": 1000 * forward / steps,
            "scheduler_share_of_step": sched / (sched + forward)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=PRESETS, default="quick")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    shape = PRESETS[args.preset]

    from bench.machine import machine_info
    from bench.workloads import shared_prefix
    from radixserve import Engine
    from radixserve.client import Client
    from radixserve.model.loader import load_tokenizer, resolve_model
    from radixserve.server.runtime import Runtime

    model_dir = resolve_model("smollm2-135m")
    tokenizer = load_tokenizer(model_dir)
    requests = shared_prefix(lambda text: tokenizer.encode(text, add_special_tokens=False),
                             seed=0, **shape)
    prompts = [list(r.segment) for r in requests]
    out = shape["output_tokens"]
    report: dict = {"preset": args.preset, "shape": shape, "concurrency": args.concurrency,
                    "machine": machine_info()}
    with Engine(str(model_dir)) as engine:
        engine.generate(input_ids=prompts[0][:8], sampling_params={"max_new_tokens": 1})
        report["engine"] = run(lambda p, sp: engine.generate(input_ids=p, sampling_params=sp),
                                 prompts, out, args.concurrency)
    print("engine", json.dumps(report["engine"]), flush=True)
    with Runtime(str(model_dir)) as rt, Client(rt.rpc_address, timeout=3600) as client:
        client.generate(input_ids=prompts[0][:8], sampling_params={"max_new_tokens": 1})
        before = client.stats()
        report["rpc"] = run(lambda p, sp: client.generate(input_ids=p, sampling_params=sp),
                              prompts, out, args.concurrency)
        report["rpc_steps"] = step_overhead(before, client.stats())
    print("rpc", json.dumps(report["rpc"]), json.dumps(report["rpc_steps"]), flush=True)
    report["rpc_vs_engine"] = (report["rpc"]["output_tokens_per_s"]
                               / report["engine"]["output_tokens_per_s"])
    save_table(report, args.out / f"rpc_vs_engine_{args.preset}", markdown(report))


def markdown(r: dict) -> str:
    s, steps = r["shape"], r["rpc_steps"]
    rows = [f"# RPC server vs in-process Engine ({r['preset']}, {r['concurrency']} concurrent)", "",
            f"{s['groups']} groups x {s['per_group']} prompts, system prompt {s['system_tokens']} "
            f"tokens, question {s['question_tokens']}, {s['output_tokens']} output tokens, greedy.",
            "", "| path | output tok/s | req/s | TTFT p50 s | TTFT p99 s | wall s |",
            "|---|---|---|---|---|---|"]
    for name in ("engine", "rpc"):
        x = r[name]
        rows.append(f"| {name} | {x['output_tokens_per_s']:.1f} | {x['requests_per_s']:.2f} | "
                    f"{x['ttft_p50_s']:.2f} | {x['ttft_p99_s']:.2f} | {x['wall_s']:.1f} |")
    rows += ["", f"- RPC / in-process throughput: **{r['rpc_vs_engine']:.3f}** (target >= 0.90)",
             f"- scheduler time per step: {steps['scheduler_ms_per_step']:.2f} ms of "
             f"{steps['forward_ms_per_step']:.1f} ms forward = "
             f"**{steps['scheduler_share_of_step']:.2%}** (target < 5%)", ""]
    return "\n".join(rows)


if __name__ == "__main__":
    main()
