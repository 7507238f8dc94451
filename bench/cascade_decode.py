"""Decode step time with tree (cascade) attention on and off, on the default model.

    python bench/cascade_decode.py --preset quick    # the batch-64 headline + a small sweep
    python bench/cascade_decode.py --preset full     # batch 1-128 x shared prefix 256-4k
    python bench/cascade_decode.py --preset shared   # batch 64 over 1k-2.5k (issue 44)
    python bench/cascade_decode.py --preset gates    # where the gates and cost model turn it on

The worker alone runs hand-built decode steps (no scheduler): `groups` groups of sequences,
each group's sequences sharing a prefix of `prefix` tokens at the same blocks (contiguous,
as a prefill gets them from the allocator), each sequence with `suffix` private tokens
after it, one new token per sequence. KV contents are whatever the pool holds: attention
reads all of it either way, so the timing is that of real steps. The same worker times
each shape with cascade on and off, interleaved; a figure is the median of `steps` steps.

Reported per shape: the whole step (ms), the attention alone (ms over all layers, the
backend called as the model calls it) and the KV bytes attention must read at least (each
shared run once with cascade, once per sequence without); both paths are timed whatever
the gates and the cost model say, and the cost model's own verdict (`worker/cascade_cost.py`,
measured by this worker; the gates, which the engine applies first, left out) is reported
beside them, with the worst step it turns on (its cascade step over the plain one; the
model must keep it under 1.03). Writes
`bench/results/cascade_decode_<preset>.{json,md,png}`.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import (best_seconds, machine_info, machine_line, measure_limits,
                           preset_args)
from bench.report import pyplot, save_figure, save_table
from radixserve.config import DEFAULT_MODEL, EngineConfig
from radixserve.messages import ForwardBatch, SeqSampling
from radixserve.model.loader import resolve_model
from radixserve.worker.attention.base import AttentionMetadata
from radixserve.worker.cascade import CascadeOptions, plan_cascade
from radixserve.worker.seq_rows import whole_tables_step
from radixserve.worker.worker import Worker

PAGE = 16
HEADLINE = dict(batch=64, groups=8, prefix=1024, suffix=64)
PLANNING = dict(batch=256, groups=32, prefix=1000, suffix=64)
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(batches=[8], prefixes=[256], group_sizes=[8], steps=2),
    "quick": dict(batches=[8, 64], prefixes=[256, 1024], group_sizes=[8], steps=3),
    "full": dict(batches=[1, 8, 32, 64, 128], prefixes=[256, 1024, 4096], group_sizes=[8],
                 steps=5),
    # Where a shared run starts to pay for its own pass: the defaults of the gates.
    "gates": dict(batches=[16, 64], prefixes=[128, 256, 512, 1024], group_sizes=[2, 4, 8],
                  steps=5),
    # Issue 44: batch 64 over 1k+ shared tokens, groups of 8 and of 32.
    "shared": dict(batches=[64], prefixes=[1024, 2560], group_sizes=[8, 32], steps=5),
}


def decode_batch(batch: int, groups: int, prefix: int, suffix: int,
                 new: int = 1) -> ForwardBatch:
    """One step of `batch` sequences in `groups` groups sharing `prefix` tokens, each taking
    `new` tokens (1: a decode; a few: a prompt's uncached tail)."""
    shared = prefix // PAGE  # whole pages only are shared; the rest is private
    kv_len = prefix + suffix + new
    own = -(-kv_len // PAGE) - shared
    first_own = groups * shared  # each sequence's own blocks follow every group's shared ones
    tables = [list(range(i % groups * shared, (i % groups + 1) * shared))
              + list(range(first_own + i * own, first_own + (i + 1) * own)) for i in range(batch)]
    greedy = SeqSampling(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, seed=0, step=0)
    return whole_tables_step(tables, input_ids=[100] * batch * new, q_lens=[new] * batch,
                             kv_lens=[kv_len] * batch, sample=[greedy] * batch,
                             logprobs=[None] * batch)


def blocks_needed(batch: int, groups: int, prefix: int, suffix: int, new: int = 1) -> int:
    return groups * (prefix // PAGE) + batch * (-(-(prefix + suffix + new) // PAGE)
                                                - prefix // PAGE)


def prepare(worker: Worker, fb: ForwardBatch) -> AttentionMetadata:
    """The worker's preparation of step `fb` alone: its tables, plan and metadata."""
    step = worker.rows.step(fb, worker.rows.apply(fb), worker.page_size)
    return worker._metadata(step, worker._plan(step))


@torch.inference_mode()
def time_attention(worker: Worker, fb: ForwardBatch) -> float:
    """Seconds of the backend's work for one step over all layers (store + attend)."""
    mc = worker.model_config
    meta = prepare(worker, fb)
    n = len(fb.input_ids)
    q = torch.randn(n, mc.num_heads, mc.head_dim)
    kv = torch.randn(n, mc.num_kv_heads, mc.head_dim)
    start = time.perf_counter()
    worker.backend.begin_forward(meta)
    for k_cache, v_cache in worker.pool.layers:
        worker.backend.forward(q, kv, kv, k_cache, v_cache, mc.head_dim ** -0.5)
    return time.perf_counter() - start


def planning_cost(worker: Worker, shape: dict[str, int], options: CascadeOptions,
                  repeats: int = 5) -> dict[str, Any]:
    """What tree attention adds to a step before the first layer (planning the groups and
    building the backend's tensors), against that step's whole time with cascade on."""
    fb = decode_batch(**shape)

    def setup_s(cascade: CascadeOptions | None) -> float:
        worker.cascade = cascade
        return best_seconds(lambda: worker.backend.begin_forward(prepare(worker, fb)), repeats)

    extra = setup_s(options) - setup_s(None)
    worker.cascade = options
    worker.forward(fb)
    start = time.perf_counter()
    worker.forward(fb)
    step = time.perf_counter() - start
    return {**shape, "plan_ms": extra * 1e3, "step_ms": step * 1e3, "share": extra / step}


def verdict(worker: Worker, fb: ForwardBatch, options: CascadeOptions) -> bool:
    """Whether the cost model alone would run step `fb` with tree attention (every group
    of two or more planned, whatever the gates)."""
    step = worker.rows.step(fb, worker.rows.apply(fb), worker.page_size)
    options = dataclasses.replace(options, min_shared_tokens=1, min_group_size=2)
    args = (step.host_tables(), step.kv_lens, step.q_lens, worker.page_size, options)
    plan = plan_cascade(*args)
    cost = worker.cascade_cost
    assert cost is not None, "the cost model is on by default"
    return plan is not None and cost.pays(plan, step.q_lens, worker.page_size)


def measure(worker: Worker, shape: dict[str, int], steps: int,
            options: CascadeOptions) -> dict[str, Any]:
    fb = decode_batch(**shape)
    mc = worker.model_config
    per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 4
    kv_len = shape["prefix"] + shape["suffix"] + 1
    shared = shape["prefix"] // PAGE * PAGE
    worker.rows.apply(fb)
    out: dict[str, Any] = {**shape, "model_on": verdict(worker, fb, options)}
    # Every group through its own pass, whatever the gates and the cost model say: they
    # are measured here.
    options = dataclasses.replace(options, min_shared_tokens=1, min_group_size=2, measured=False)
    for name in ("plain", "cascade"):
        out[name] = {"step_ms": [], "attention_ms": []}
    for _ in range(steps + 1):  # the first round warms up both paths
        for name, cascade in (("plain", None), ("cascade", options)):
            worker.cascade = cascade
            start = time.perf_counter()
            worker.forward(fb)
            out[name]["step_ms"].append((time.perf_counter() - start) * 1e3)
            out[name]["attention_ms"].append(time_attention(worker, fb) * 1e3)
    for name in ("plain", "cascade"):
        r = out[name]
        r["step_ms"], r["attention_ms"] = r["step_ms"][1:], r["attention_ms"][1:]
        r["step_ms_median"] = statistics.median(r["step_ms"])
        r["attention_ms_median"] = statistics.median(r["attention_ms"])
    grouped = shape["batch"] // shape["groups"] >= 2
    out["plain"]["kv_bytes"] = shape["batch"] * kv_len * per_token
    out["cascade"]["kv_bytes"] = (shape["groups"] * shared + shape["batch"] * (kv_len - shared)) \
        * per_token if grouped else out["plain"]["kv_bytes"]
    out["step_speedup"] = out["plain"]["step_ms_median"] / out["cascade"]["step_ms_median"]
    out["attention_speedup"] = (out["plain"]["attention_ms_median"]
                                / out["cascade"]["attention_ms_median"])
    return out


def sweep_shapes(preset: dict[str, Any]) -> list[dict[str, int]]:
    return [dict(batch=batch, groups=max(1, batch // size), prefix=prefix, suffix=64)
            for size in preset["group_sizes"] for prefix in preset["prefixes"]
            for batch in preset["batches"]]


def markdown(report: dict[str, Any]) -> str:
    m, lim = report["machine"], report["limits"]
    h = report["headline"]
    lines = [f"# Decode step with tree attention: preset `{report['preset']}`", "",
             machine_line(m, m["torch_threads"]) + ". Model "
             f"`{report['model']}`, float32, page size {PAGE}. Measured limits (same run): fp32 "
             f"matmul {lim['matmul_gflops']:.1f} GFLOP/s, memory read {lim['read_gbs']:.1f} GB/s.",
             "", f"Headline: batch {h['batch']} = {h['groups']} groups x "
             f"{h['batch'] // h['groups']}, {h['prefix']}-token shared prefix, "
             f"{h['suffix']}-token private suffixes: step {h['plain']['step_ms_median']:.0f} ms "
             f"-> {h['cascade']['step_ms_median']:.0f} ms (**{h['step_speedup']:.2f}x**), "
             f"attention {h['plain']['attention_ms_median']:.0f} ms -> "
             f"{h['cascade']['attention_ms_median']:.0f} ms (**{h['attention_speedup']:.2f}x**).",
             "", f"Planning (batch {report['planning']['batch']}, {report['planning']['groups']} "
             f"groups): {report['planning']['plan_ms']:.2f} ms per step = "
             f"{report['planning']['share']:.2%} of the {report['planning']['step_ms']:.0f} ms "
             "cascade step.",
             "", cost_line(report),
             "", "| batch | groups | shared prefix | cost model | step plain ms | step cascade ms "
             "| step x | attention plain ms | attention cascade ms | attention x "
             "| KV read plain MB | KV read cascade MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in [h, *report["sweep"]]:
        lines.append(
            f"| {r['batch']} | {r['groups']} | {r['prefix']} | "
            f"{'on' if r['model_on'] else 'off'} | {r['plain']['step_ms_median']:.1f} | "
            f"{r['cascade']['step_ms_median']:.1f} | {r['step_speedup']:.2f} | "
            f"{r['plain']['attention_ms_median']:.1f} | "
            f"{r['cascade']['attention_ms_median']:.1f} | {r['attention_speedup']:.2f} | "
            f"{r['plain']['kv_bytes'] / 1e6:.0f} | {r['cascade']['kv_bytes'] / 1e6:.0f} |")
    return "\n".join(lines) + "\n"


def cost_line(report: dict[str, Any]) -> str:
    """The cost model's measured costs, and its worst calls: the slowest cascade step and
    attention (over the plain ones) among the shapes it turns on."""
    c = report["cost"]
    on = [r for r in [report["headline"], *report["sweep"]] if r["model_on"]]
    worst = (f"among the shapes it turns on, the worst step runs at "
             f"{min(r['step_speedup'] for r in on):.2f}x plain's and the worst attention at "
             f"{min(r['attention_speedup'] for r in on):.2f}x" if on
             else "it turns on no shape")
    return (f"Cost model (measured by this worker, per layer): a key read by a row itself "
            f"{c['plain_key'] * 1e9:.1f} ns, its share of a shared run's key "
            f"{c['shared_key'] * 1e9:.1f} ns, fixed {c['per_level'] * 1e6:.0f} us per level + "
            f"{c['per_row'] * 1e6:.1f} us per grouped row + {c['per_step'] * 1e6:.0f} us per "
            f"step; {worst}.")


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    sweep = [r for r in report["sweep"] if r["batch"] // r["groups"] in (1, 8)]
    prefixes = sorted({r["prefix"] for r in sweep})
    batches = sorted({r["batch"] for r in sweep})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for i, prefix in enumerate(prefixes):
        rows = sorted((r for r in sweep if r["prefix"] == prefix), key=lambda r: r["batch"])
        for name, style in (("plain", "--"), ("cascade", "-")):
            axes[0].plot([r["batch"] for r in rows], [r[name]["step_ms_median"] for r in rows],
                         style, marker="o", color=f"C{i}", label=f"{name}, prefix {prefix}")
    axes[0].set_xlabel("decode batch size (groups of 8)")
    axes[0].set_title("step time against batch size")
    batch = max(b for b in batches if any(r["batch"] == b for r in sweep))
    for i, b in enumerate([b for b in batches if b > 1][-2:] or [batch]):
        rows = sorted((r for r in sweep if r["batch"] == b), key=lambda r: r["prefix"])
        for name, style in (("plain", "--"), ("cascade", "-")):
            axes[1].plot([r["prefix"] for r in rows], [r[name]["step_ms_median"] for r in rows],
                         style, marker="o", color=f"C{i + len(prefixes)}",
                         label=f"{name}, batch {b}")
    axes[1].set_xlabel("shared prefix tokens")
    axes[1].set_xscale("log", base=2)
    axes[1].set_title("step time against shared prefix")
    for ax in axes:
        ax.set_ylabel("decode step ms")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    save_figure(fig, path)


def main() -> None:
    args = preset_args(__doc__, PRESETS, DEFAULT_MODEL, threads=True)
    preset = PRESETS[args.preset]
    shapes = sweep_shapes(preset)
    blocks = max(blocks_needed(**s) for s in [HEADLINE, PLANNING, *shapes])
    config = EngineConfig(model=args.model, max_total_tokens=blocks * PAGE, page_size=PAGE,
                          device="cpu")
    worker = Worker(config, resolve_model(args.model))
    options = worker.cascade
    assert options is not None, "cascade attention is on by default"
    limits = measure_limits()
    report: dict[str, Any] = {"preset": args.preset, "model": args.model,
                              "machine": machine_info(), "limits": limits,
                              "options": options.__dict__}
    assert worker.cascade_cost is not None, "the cost model is on by default"
    report["cost"] = dataclasses.asdict(worker.cascade_cost)
    report["headline"] = measure(worker, HEADLINE, preset["steps"], options)
    print(f"headline: {report['headline']['step_speedup']:.2f}x step, "
          f"{report['headline']['attention_speedup']:.2f}x attention", flush=True)
    report["planning"] = planning_cost(worker, PLANNING, options)
    report["sweep"] = []
    for shape in shapes:
        report["sweep"].append(measure(worker, shape, preset["steps"], options))
        r = report["sweep"][-1]
        print(f"{shape}: plain {r['plain']['step_ms_median']:.0f} ms, cascade "
              f"{r['cascade']['step_ms_median']:.0f} ms", flush=True)
    stem = args.out / f"cascade_decode_{args.preset}"
    save_table(report, stem, markdown(report))
    plot(report, stem.with_suffix(".png"))


if __name__ == "__main__":
    main()
