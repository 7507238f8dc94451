"""The virtual KV layout (vAttention, `kv_layout="virtual"`) against the paged one, on the CPU.

    python bench/virtual_kv.py --preset quick    # batch 1-64 x context 256 and 2k
    python bench/virtual_kv.py --preset full     # batch 1-64 x context 256-2k, more steps
    python bench/virtual_kv.py --preset full --rerun 8x512,64x256   # those rows again

Three measurements, on the default model (SmolLM2-135M: 30 layers, 3 KV heads of 64,
float32, page size 16), one paged and one virtual worker side by side, no scheduler:

- decode: hand-built decode steps as in `bench/cascade_decode.py` (groups of 8 sequences
  sharing all but the last 64 tokens of their context, one new token each), each layout
  with tree attention off and on (every group through its own pass), interleaved; the
  median step of `steps` after a warm-up round that also does the virtual layout's
  mapping. Also the attention alone (store + attend, all layers). The variants run
  back to back in each round, in reverse order every other round; `virtual x` is the
  median over rounds of each round's paged ÷ virtual step.
- mapping: what the virtual layout pays once per block and slot: the `mmap`s of a block
  into a view (a table of contiguous block ids is one call per region, each layer's K and
  V; scattered ids that many per block), and
  the first read through the new view (the kernel filling its page tables).
- prefill: one prompt of `prompt` tokens in chunks of 512 (time to first token, the
  worker's share), each layout.

Writes `bench/results/virtual_kv_<preset>.{json,md,png}`. Each decode row records the
load average it started at; on a shared machine a row a neighbour's load disturbed is
measured again with `--rerun BATCHxCONTEXT,...` (the rows replaced in the preset's results,
marked in the table, the rest kept).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any


if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cascade_decode import PAGE, blocks_needed, decode_batch, time_attention
from bench.machine import machine_info, machine_line, measure_limits, micro_args
from bench.report import save_table
from radixserve.config import DEFAULT_MODEL, EngineConfig
from radixserve.messages import SeqSampling
from radixserve.model.loader import resolve_model
from radixserve.worker.cascade import CascadeOptions
from radixserve.worker.virtual_kv import VirtualKVPool
from radixserve.worker.vma_budget import process_mappings
from radixserve.worker.seq_rows import whole_tables_step
from radixserve.worker.worker import Worker

SUFFIX = 64
GROUP = 8
CHUNK = 512
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(batches=[8], contexts=[256], steps=1, prompts=[256]),
    "quick": dict(batches=[1, 8, 32, 64], contexts=[256, 2048], steps=5, prompts=[256, 1024]),
    "full": dict(batches=[1, 8, 32, 64], contexts=[256, 512, 1024, 2048], steps=9,
                 prompts=[256, 1024, 2048]),
}
VARIANTS = [("paged", False), ("paged", True), ("virtual", False), ("virtual", True)]
EARLIER = ("virtual_speedup", "virtual_tree_speedup", "load")
"""What a re-run row keeps of each earlier measurement of it."""


def shape(batch: int, context: int) -> dict[str, int]:
    return dict(batch=batch, groups=max(1, batch // GROUP), prefix=context - SUFFIX,
                suffix=SUFFIX)


def measure_decode(workers: dict[str, Worker], tree_options: CascadeOptions, batch: int,
                   context: int, steps: int) -> dict[str, Any]:
    fb = decode_batch(**shape(batch, context))
    out: dict[str, Any] = {"batch": batch, "context": context, "load": os.getloadavg()[0]}
    runs: dict[str, dict[str, list[float]]] = {}
    for i in range(steps + 1):  # the first round warms up every path (and maps the views)
        # Every other round in reverse, so that no variant always runs after the same one.
        for layout, tree in VARIANTS if i % 2 else VARIANTS[::-1]:
            worker = workers[layout]
            worker.cascade = tree_options if tree else None
            key = f"{layout}{'+tree' if tree else ''}"
            r = runs.setdefault(key, {"step_ms": [], "attention_ms": []})
            start = time.perf_counter()
            worker.forward(fb)
            r["step_ms"].append((time.perf_counter() - start) * 1e3)
            r["attention_ms"].append(time_attention(worker, fb) * 1e3)
    for key, r in runs.items():
        out[key] = {"step_ms": statistics.median(r["step_ms"][1:]),
                    "attention_ms": statistics.median(r["attention_ms"][1:])}
    # Each round's ratio, then their median: rounds are seconds apart and the machine's
    # speed drifts over a row, which a ratio of the two medians would take in.
    def speedup(paged: str, virtual: str) -> float:
        return statistics.median(p / v for p, v in zip(runs[paged]["step_ms"][1:],
                                                       runs[virtual]["step_ms"][1:]))
    out["virtual_speedup"] = speedup("paged", "virtual")
    out["virtual_tree_speedup"] = speedup("paged+tree", "virtual+tree")
    return out


def measure_mapping(worker: Worker, repeats: int = 3) -> dict[str, Any]:
    """Per block: the mmap into a view and the first read through it (page-table fill)."""
    pool = worker.pool
    assert isinstance(pool, VirtualKVPool)
    blocks = min(128, pool.slot_blocks, pool.num_blocks)
    out: dict[str, Any] = {"blocks": blocks, "block_bytes": pool.unit * pool.regions,
                           "regions": pool.regions}
    tables = {"contiguous": list(range(blocks)),
              "scattered": random.Random(0).sample(range(pool.num_blocks), blocks)}
    kv = blocks * PAGE
    for kind, table in tables.items():
        map_s, touch_s, calls = [], [], []
        for _ in range(repeats):
            pool.release_all()
            before = pool.stats.mmap_calls
            start = time.perf_counter()
            pool.prepare([table], [kv], [1], [])
            mapped = time.perf_counter()
            for k, v in pool.layers:  # slot 0's view: its first `blocks` view blocks
                k[:blocks].sum(), v[:blocks].sum()
            touched = time.perf_counter()
            for k, v in pool.layers:
                k[:blocks].sum(), v[:blocks].sum()
            again = time.perf_counter()
            map_s.append(mapped - start)
            touch_s.append((touched - mapped) - (again - touched))
            calls.append(pool.stats.mmap_calls - before)
        out[kind] = {"map_us_per_block": 1e6 * min(map_s) / blocks,
                     "first_read_us_per_block": 1e6 * min(touch_s) / blocks,
                     "mmap_calls": calls[0]}
    pool.release_all()
    return out


def measure_prefill(workers: dict[str, Worker], prompt: int) -> dict[str, Any]:
    """One prompt's chunks through each worker: the worker's share of the TTFT."""
    out: dict[str, Any] = {"prompt": prompt}
    greedy = SeqSampling(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, seed=0, step=0)
    table = list(range(-(-prompt // PAGE)))
    for layout, worker in workers.items():
        worker.cascade = None
        best = float("inf")
        for _ in range(2):
            worker.pool.release_all()
            start = time.perf_counter()
            for lo in range(0, prompt, CHUNK):
                hi = min(prompt, lo + CHUNK)
                worker.forward(whole_tables_step(
                    [table[:-(-hi // PAGE)]], input_ids=[100] * (hi - lo), q_lens=[hi - lo],
                    kv_lens=[hi], sample=[greedy if hi == prompt else None], logprobs=[None]))
            best = min(best, time.perf_counter() - start)
        out[f"{layout}_ms"] = best * 1e3
    return out


def markdown(report: dict[str, Any]) -> str:
    m, lim = report["machine"], report["limits"]
    mp = report["mapping"]
    lines = [f"# Virtual KV layout (vAttention) against paged: preset `{report['preset']}`", "",
             machine_line(m, m["torch_threads"]) + ". Model "
             f"`{report['model']}`, float32, page size {PAGE}. Measured limits (same run): fp32 "
             f"matmul {lim['matmul_gflops']:.1f} GFLOP/s, memory read {lim['read_gbs']:.1f} GB/s. "
             f"vm.max_map_count {report['max_map_count']}; the virtual worker's budget "
             f"{report['mappings_budget']} view mappings ({report['mapping']['regions']} "
             f"memory mappings each), {report['mappings_at_end']} memory mappings held by the "
             "process at the end of the decode sweep.", "",
             "## Decode step (ms, median)", "",
             f"Groups of {GROUP} sequences sharing all but the last {SUFFIX} tokens of their "
             "context; `+tree`: tree attention, every group in its own pass; attention = store "
             "+ attend, all layers; `virtual x`: the median over rounds of each round's paged ÷ "
             "virtual step. Load: the load average as the row started (the machine "
             "is shared); `*`: a row measured again (`--rerun`).", "",
             "| batch | context | paged | virtual | virtual x | paged+tree | virtual+tree "
             "| virtual+tree x | attention paged | attention virtual | attention paged+tree "
             "| attention virtual+tree | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["decode"]:
        lines.append(
            f"| {r['batch']}{'*' if r.get('rerun') else ''} | {r['context']} | "
            f"{r['paged']['step_ms']:.1f} | "
            f"{r['virtual']['step_ms']:.1f} | {r['virtual_speedup']:.2f} | "
            f"{r['paged+tree']['step_ms']:.1f} | {r['virtual+tree']['step_ms']:.1f} | "
            f"{r['virtual_tree_speedup']:.2f} | {r['paged']['attention_ms']:.1f} | "
            f"{r['virtual']['attention_ms']:.1f} | {r['paged+tree']['attention_ms']:.1f} | "
            f"{r['virtual+tree']['attention_ms']:.1f} | {r.get('load', 0):.1f} |")
    reruns = [r for r in report["decode"] if r.get("earlier")]
    if reruns:
        lines += ["", "Earlier measurements of the re-run rows (virtual x, virtual+tree x, "
                  "load): " + "; ".join(
                      f"{r['batch']}x{r['context']}: " + ", ".join(
                          f"{e['virtual_speedup']:.2f} / {e['virtual_tree_speedup']:.2f} "
                          f"({e['load']:.1f})" for e in r["earlier"]) for r in reruns) + "."]
    lines += ["", f"## Mapping a block ({mp['block_bytes'] // 1024} KiB: K and V of all layers, "
              f"in {mp['regions']} regions)",
              "", "| block ids | mmap calls for "
              f"{mp['blocks']} blocks | map us/block | first read us/block |", "|---|---|---|---|"]
    for kind in ("contiguous", "scattered"):
        r = mp[kind]
        lines.append(f"| {kind} | {r['mmap_calls']} | {r['map_us_per_block']:.1f} | "
                     f"{r['first_read_us_per_block']:.1f} |")
    lines += ["", "Both once per block and slot.", "",
              "## Prefill (worker's time to first token, chunks of 512, ms)", "",
              "| prompt tokens | paged | virtual |", "|---|---|---|"]
    for r in report["prefill"]:
        lines.append(f"| {r['prompt']} | {r['paged_ms']:.0f} | {r['virtual_ms']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in report["decode"]})
    fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        rows = sorted((r for r in report["decode"] if r["context"] == context),
                      key=lambda r: r["batch"])
        for i, (layout, tree) in enumerate(VARIANTS):
            key = f"{layout}{'+tree' if tree else ''}"
            ax.plot([r["batch"] for r in rows], [r[key]["step_ms"] for r in rows],
                    "-" if layout == "virtual" else "--", marker="o", color=f"C{i}", label=key)
        ax.set_xlabel("decode batch size")
        ax.set_ylabel("decode step ms")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"context {context}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def rerun(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`new` in place of the row `old`, which it keeps as an earlier measurement."""
    earlier = old.get("earlier", []) + [{k: old[k] for k in EARLIER}]
    return {**new, "rerun": True, "earlier": earlier}


def rows(text: str) -> list[tuple[int, int]]:
    """`8x512,64x256` -> [(8, 512), (64, 256)]: (batch, context) rows."""
    return [(int(b), int(c)) for b, c in (row.split("x") for row in text.split(","))]


def main() -> None:
    args = micro_args(__doc__, PRESETS, DEFAULT_MODEL, lambda p: p.add_argument(
        "--rerun", type=rows, default=None, help="BATCHxCONTEXT,...: measure these decode "
        "rows again and replace them in the preset's results"))
    preset = PRESETS[args.preset]
    stem = args.out / f"virtual_kv_{args.preset}"
    longest = max(preset["contexts"] + preset["prompts"])
    blocks = max([blocks_needed(**shape(b, c)) for b in preset["batches"]
                  for c in preset["contexts"]] + [-(-longest // PAGE)])
    model_dir = resolve_model(args.model)
    workers = {}
    for layout in ("paged", "virtual"):
        config = EngineConfig(model=args.model, max_total_tokens=blocks * PAGE, page_size=PAGE,
                              device="cpu", kv_layout=layout,
                              max_running_requests=max(preset["batches"]),
                              context_length=longest + PAGE)
        workers[layout] = Worker(config, model_dir)
    # Tree attention with every group through its own pass (the gates are not measured).
    tree_options = dataclasses.replace(CascadeOptions.from_config(config), min_shared_tokens=1,
                                       min_group_size=2)
    with open("/proc/sys/vm/max_map_count") as f:
        max_map_count = int(f.read())
    report: dict[str, Any] = {"preset": args.preset, "model": args.model,
                              "machine": machine_info(), "limits": measure_limits(),
                              "max_map_count": max_map_count,
                              "mappings_budget": workers["virtual"].pool.budget.views_budget,
                              "decode": []}
    if args.rerun:  # at the commit the results name (the rows are compared with theirs)
        report = json.loads(stem.with_suffix(".json").read_text())
    for context in preset["contexts"]:
        for batch in preset["batches"]:
            if args.rerun and (batch, context) not in args.rerun:
                continue
            r = measure_decode(workers, tree_options, batch, context, preset["steps"])
            if args.rerun:
                report["decode"] = [rerun(old, r) if (old["batch"], old["context"]) ==
                                    (batch, context) else old for old in report["decode"]]
            else:
                report["decode"].append(r)
            print(f"batch {batch} context {context}: paged {r['paged']['step_ms']:.0f} ms, "
                  f"virtual {r['virtual']['step_ms']:.0f} ms, paged+tree "
                  f"{r['paged+tree']['step_ms']:.0f} ms, virtual+tree "
                  f"{r['virtual+tree']['step_ms']:.0f} ms", flush=True)
    if not args.rerun:
        report["mappings_at_end"] = process_mappings()
        report["mapping"] = measure_mapping(workers["virtual"])
        report["prefill"] = [measure_prefill(workers, n) for n in preset["prompts"]]
    save_table(report, stem, markdown(report))
    plot(report, stem.with_suffix(".png"))


if __name__ == "__main__":
    main()
