"""The Engine end to end with tree attention on and off (issue 44), on the CPU.

    python bench/cascade_engine.py --preset quick   # batch 64 = 2 groups x 32 over 1k tokens
    python bench/cascade_engine.py --preset long    # 2 groups x 24 over 2.5k tokens
    python bench/cascade_engine.py --preset tiny --out /tmp/e2e   # a tiny random model

The workload: `groups` groups of `per_group` requests sharing a `prefix`-token prompt per
group, then `own` tokens each; greedy, EOS ignored. Two engines with the defaults but
`enable_cascade_attention` (on: the gates and cost model decide each step; off: never), one
after the other, each given each group's prefix once first (cached). Per engine: the whole
run (prefill of the own tokens and `new` tokens of decode), the decode alone (the prompts
now cached: `new` less `short` tokens, per step, at batch groups x per_group), the prefill
(the whole run less its `new` - 1 decode steps), the steps tree attention ran, and whether
its greedy output equals the other engine's. Writes `bench/results/cascade_engine_<preset>.*`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.workloads import greedy, prompts  # noqa: E402
from bench.machine import machine_info, machine_line, preset_args  # noqa: E402
from bench.report import save_table  # noqa: E402
from radixserve.config import DEFAULT_MODEL  # noqa: E402

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(groups=2, per_group=4, prefix=48, own=4, short=2, new=6, tiny=True),
    "quick": dict(groups=2, per_group=32, prefix=1024, own=16, short=8, new=40),
    "long": dict(groups=2, per_group=24, prefix=2560, own=16, short=8, new=40),
}


def workload(shape: dict[str, Any]) -> list[list[int]]:
    """Each group's requests, group after group: a prefix of its own per group."""
    return [ids for g in range(shape["groups"])
            for ids in prompts(shape["per_group"], shape["prefix"], shape["own"], seed=g)]


def timed(engine: Any, ids: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    results = engine.generate(input_ids=ids, sampling_params=greedy(new))
    return time.perf_counter() - start, [r["output_ids"] for r in results]


def run_engine(model: str, cascade: bool, shape: dict[str, Any]) -> dict[str, Any]:
    import radixserve

    ids = workload(shape)
    batch = len(ids)
    tokens = shape["groups"] * shape["prefix"] + batch * (shape["own"] + shape["new"] + 16)
    engine = radixserve.Engine(model=model, device="cpu", enable_cascade_attention=cascade,
                               max_running_requests=batch, max_total_tokens=2 * tokens)
    try:
        timed(engine, ids[::shape["per_group"]], 1)  # each group's prefix, cached
        whole, outputs = timed(engine, ids, shape["new"])
        short, _ = timed(engine, ids, shape["short"])
        long, _ = timed(engine, ids, shape["new"])
        stats = engine.stats()
    finally:
        engine.shutdown()
    step = (long - short) / (shape["new"] - shape["short"])
    return {"cascade": cascade, "whole_s": whole, "tok_s": batch * shape["new"] / whole,
            "decode_ms_per_step": step * 1e3, "prefill_s": whole - (shape["new"] - 1) * step,
            "cascade_steps": stats["cascade_steps"], "steps": stats["steps"], "outputs": outputs}


def markdown(report: dict[str, Any]) -> str:
    s, (off, on) = report["shape"], report["runs"]
    lines = [f"# The Engine with tree attention on and off: preset `{report['preset']}`", "",
             report["machine"] + f". Model `{report['model']}`, float32.", "",
             f"{s['groups']} groups x {s['per_group']} requests (batch "
             f"{s['groups'] * s['per_group']}), each group sharing a {s['prefix']}-token "
             f"prompt (cached first), {s['own']} own tokens each, {s['new']} new tokens, "
             "greedy.", "",
             "| tree attention | whole run s | of which prefill s | out tok/s | decode ms/step "
             "| steps | cascade steps |", "|---|---|---|---|---|---|---|"]
    for r in (off, on):
        lines.append(f"| {'on' if r['cascade'] else 'off'} | {r['whole_s']:.1f} | "
                     f"{r['prefill_s']:.1f} | {r['tok_s']:.1f} | "
                     f"{r['decode_ms_per_step']:.0f} | {r['steps']} | {r['cascade_steps']} |")
    lines += ["", f"On vs off: whole run **{off['whole_s'] / on['whole_s']:.2f}x** (prefill, the "
              f"whole less {s['new'] - 1} decode steps, {off['prefill_s'] / on['prefill_s']:.2f}x)"
              f", decode step **{off['decode_ms_per_step'] / on['decode_ms_per_step']:.2f}x**; "
              f"greedy outputs equal: {report['agreement']}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = preset_args(__doc__ or "", PRESETS, DEFAULT_MODEL, threads=True)
    shape = PRESETS[args.preset]
    model = args.model
    if shape.get("tiny"):
        from tests.factories import tiny_model_dir

        model = str(tiny_model_dir(args.out / "models", num_layers=2, hidden_size=64))
    machine = machine_info()
    runs = [run_engine(model, cascade, shape) for cascade in (False, True)]
    same = sum(a == b for a, b in zip(runs[0].pop("outputs"), runs[1].pop("outputs")))
    report = {"preset": args.preset, "model": model, "shape": shape,
              "machine": machine_line(machine, torch.get_num_threads()),
              "machine_info": machine, "runs": runs,
              "agreement": f"{same}/{shape['groups'] * shape['per_group']}"}
    save_table(report, args.out / f"cascade_engine_{args.preset}", markdown(report))


if __name__ == "__main__":
    main()
