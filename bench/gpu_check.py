"""One-command GPU check of the Triton attention path (sized for < 8 minutes on one H200).

    python bench/gpu_check.py --out $OUT

Sections (each guarded: a failure is recorded and the rest still run):
1. correctness: every kernel against its torch reference in bf16 on random ragged shapes
   (reference in fp32 on the same bf16 values; target: max relative error <= 1e-2);
2. copy bandwidth: a large device-to-device copy (read + write bytes / time);
3. paged decode, batch 64 x 4k context: achieved bandwidth (KV + q + out bytes / time)
   against the copy bandwidth (target >= 70%), plus a small sweep of launch knobs;
4. tree (cascade) attention: a decode step of 64 sequences in 8 groups of 8 over a
   1,000-token prefix per group (64-token private suffixes) through the Triton backend,
   with the step's cascade plan and without (per-layer attention time, GB/s of KV read,
   speedup; agreement of the two outputs), plus a small sweep of the cascade launch knobs;
5. extend vs torch SDPA (flash backend) on the same shapes laid out contiguously
   (target: Triton time <= 1.3x SDPA), plus a small sweep of tile configs;
6. the virtual KV layout on CUDA VMM (`worker/virtual_kv_cuda.py`), in both page layouts
   (`worker/virtual_pages.py`: `block` at page size 91, whose bf16 blocks fill 2 MiB pages;
   `layer` at 5,461): the cost of mapping a block, the decode kernel over the views
   (`contiguous=True`) against the paged read of the same blocks at batch 8/32/64 x 2k
   context, the default model's greedy outputs virtual vs paged, the steps that waited
   for a mapping (the rest were mapped ahead), and the views unmapped after a flush;
7. `--quantization int8|q4` on CUDA: refused at start-up (no CUDA kernels are wired);
8. tensor parallelism over 2 GPUs (NCCL): `Engine(tp_size=2)`'s greedy outputs against
   `tp_size=1`'s in float32, and a batch-64 decode step of each (skipped, saying why, on
   a machine with fewer than 2 GPUs);
9. end to end: the shared-prefix workload through `radixserve.Engine` with the default
   model (cache hit rate, throughput, greedy agreement with the torch backend);
10. the GPU step (`bench/gpu_e2e.py`): CUDA graphs and overlap each on and off against
   transformers' `generate`: output tok/s, ms per decode step at batch 1/8/32/64, the GPU's
   busy share, greedy agreement with graphs off (its own table under `--out`/e2e too).
Prints one table and writes `gpu_check.json` under `--out`. Timings use CUDA events.
Sections 1-5 are in bench/gpu_attention.py, the shared timing and rows in bench/gpu_timing.py.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # bench.* and tests.factories (the tensor-parallel model)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_attention import (  # noqa: E402
    section_bandwidth,
    section_cascade,
    section_correctness,
    section_decode,
    section_extend,
)
from bench.gpu_timing import ROWS, T0, cuda_time, rel, row  # noqa: E402


def decode_over_views(layout: str, page: int, batch: int, ctx: int, hkv: int, d: int,
                      dtype: torch.dtype) -> None:
    """One layer's decode over the views of a `layout` pool against the paged read of the
    same blocks, the mapping cost per block, and the views unmapped after a release."""
    from radixserve.kernels.decode_attention import paged_decode_attention
    from radixserve.worker.virtual_kv_cuda import CudaVirtualKVPool

    blocks_per_seq = -(-ctx // page)
    pool = CudaVirtualKVPool(30, batch * blocks_per_seq + 1, page, hkv, d, dtype,
                             num_slots=batch, slot_blocks=blocks_per_seq,
                             device=torch.device("cuda"), page_layout=layout)
    perm = torch.randperm(pool.num_blocks)[:batch * blocks_per_seq].tolist()
    tables = [perm[i * blocks_per_seq:(i + 1) * blocks_per_seq] for i in range(batch)]
    kv_lens = [ctx] * batch
    t0 = time.perf_counter()
    slots = pool.prepare(tables, kv_lens, [1] * batch, [])
    torch.cuda.synchronize()
    map_us = (time.perf_counter() - t0) / (batch * blocks_per_seq) * 1e6
    pool.buffer.normal_()
    q = torch.randn(batch, hkv * 3, d, device="cuda", dtype=dtype)
    lens = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
    k_view, v_view = pool.layers[0]
    view_tables = pool.view_tables(slots, blocks_per_seq).cuda()
    k_phys, v_phys = pool.physical[0]
    paged_tables = torch.tensor(tables, dtype=torch.int32, device="cuda")
    virt = functools.partial(paged_decode_attention, q, k_view, v_view, view_tables,
                             lens, 0.125, max_kv_len=ctx, contiguous=True)
    pag = functools.partial(paged_decode_attention, q, k_phys, v_phys, paged_tables, lens,
                            0.125, max_kv_len=ctx)
    agree = rel(virt().float(), pag().float())
    t_virt, t_pag = cuda_time(virt), cuda_time(pag)
    name = f"{layout} page {page}, batch {batch} x {ctx}"
    row("virtual", f"{name}: decode paged/virtual time", t_pag / t_virt, ">= 0.95",
        t_pag / t_virt >= 0.95, paged_us=t_pag * 1e6, virtual_us=t_virt * 1e6,
        rel_err=agree, map_us_per_block=map_us, handles_per_block=pool.regions)
    pool.release_all()
    row("virtual", f"{name}: mappings after release", pool.mapping_count(), "1",
        pool.mapping_count() == 1)


def section_virtual() -> None:
    import radixserve

    hkv, d, ctx, dtype = 3, 64, 2048, torch.bfloat16  # the default model's shape
    # Its two page layouts: 91-token blocks of all 30 layers in a 2 MiB page, or a 2 MiB
    # page per layer's K or V (5,461 tokens: one block a sequence here).
    for layout, page in (("block", 91), ("layer", 5461)):
        for batch in (8, 32, 64):
            decode_over_views(layout, page, batch, ctx, hkv, d, dtype)
    prefix = "You are a careful assistant. " + " ".join(
        f"Fact {i}: item {i} costs {i * 7 % 101} coins." for i in range(60))
    prompts = [prefix + f" Question: how many coins does item {i} cost?" for i in range(16)]
    params = {"max_new_tokens": 32, "temperature": 0.0}
    outs = {}
    for layout in ("paged", "virtual"):
        engine = radixserve.Engine(model="smollm2-135m", device="cuda", dtype="bfloat16",
                                   attention_backend="triton", kv_layout=layout, page_size=91,
                                   max_running_requests=32, max_total_tokens=200_000)
        try:
            engine.generate(prompt=prompts[:1], sampling_params=params)
            t0 = time.perf_counter()
            outs[layout] = [r["output_ids"] for r in
                            engine.generate(prompt=prompts, sampling_params=params)]
            wall = time.perf_counter() - t0
            engine.flush_cache()
            if layout == "virtual":
                pool = engine.worker.pool
                row("virtual", "engine: mappings after flush", pool.mapping_count(), "1",
                    pool.mapping_count() == 1)
                row("virtual", "engine: steps that waited for a mapping", pool.stats.map_waits,
                    "counted", None, wait_s=pool.stats.map_wait_seconds,
                    mapped_ahead=pool.stats.mapped_ahead, blocks_mapped=pool.stats.blocks_mapped)
            row("virtual", f"engine {layout}: 16 requests wall s", wall)
        finally:
            engine.shutdown()
    same = sum(a == b for a, b in zip(outs["paged"], outs["virtual"]))
    row("virtual", "greedy outputs identical virtual vs paged (bf16)", f"{same}/16", "16/16",
        same == 16)


def section_e2e(args: argparse.Namespace) -> None:
    import radixserve

    torch.cuda.empty_cache()
    prefix = ("You are a careful assistant. Use the facts below.\n" + " ".join(
        f"Fact {i}: item {i} costs {i * 7 % 101} coins." for i in range(120)) + "\n")
    prompts = [prefix + f"Question: how many coins does item {i} cost?" for i in range(33)]
    params = {"max_new_tokens": 64, "temperature": 0.0}
    outs: dict[str, list[dict[str, Any]]] = {}
    for backend in ("triton", "torch"):
        if backend == "torch" and time.perf_counter() - T0 > args.budget_s - 60:
            break
        t0 = time.perf_counter()
        engine = radixserve.Engine(model="smollm2-135m", device="cuda", dtype="bfloat16",
                                   attention_backend=backend)
        try:
            load_s = time.perf_counter() - t0
            batch = prompts if backend == "triton" else prompts[:9]
            engine.generate(prompt=[batch[0]], sampling_params=params)  # warm + cache prefix
            t1 = time.perf_counter()
            res = engine.generate(prompt=batch[1:], sampling_params=params)
            wall = time.perf_counter() - t1
        finally:
            getattr(engine, "shutdown", lambda: None)()
        res = [res] if isinstance(res, dict) else list(res)
        outs[backend] = res
        cached = sum(r["meta_info"]["cached_tokens"] for r in res)
        prompt_toks = sum(r["meta_info"]["prompt_tokens"] for r in res)
        gen_toks = sum(r["meta_info"]["completion_tokens"] for r in res)
        row("e2e", f"{backend}: cached/prompt tokens", cached / max(prompt_toks, 1),
            "> 0.8", cached / max(prompt_toks, 1) > 0.8, load_s=load_s, wall_s=wall)
        row("e2e", f"{backend}: {len(res)} requests, output tok/s", gen_toks / wall,
            sample=res[0].get("text", "")[:120])
    if "torch" in outs:
        n = len(outs["torch"])
        same = sum(a["output_ids"] == b["output_ids"]
                   for a, b in zip(outs["triton"][:n], outs["torch"]))
        row("e2e", "greedy outputs identical triton vs torch (bf16)", f"{same}/{n}")


def section_gpu_step(args: argparse.Namespace) -> None:
    from bench import gpu_e2e

    report = gpu_e2e.run(Path(args.out) / "e2e")
    hf = report["transformers"]["tok_s"]
    row("gpu_step", "transformers generate, output tok/s", hf)
    for r in report["runs"]:
        name = r["config"]
        row("gpu_step", f"{name}: output tok/s x transformers", r["tok_s"] / hf, ">= 20",
            r["tok_s"] / hf >= 20, tok_s=r["tok_s"])
        row("gpu_step", f"{name}: ms per decode step at batch 32", r["ms_per_step"][32],
            "<= 2", r["ms_per_step"][32] <= 2, ms_per_step=r["ms_per_step"])
        row("gpu_step", f"{name}: GPU busy share at batch 32", r["busy_share"], ">= 0.6",
            r["busy_share"] is not None and r["busy_share"] >= 0.6)
        row("gpu_step", f"{name}: greedy = graphs off", r["agreement"],
            graph_steps=r["graph_steps"], eager_steps=r["eager_steps"])


def tp_model() -> tuple[str, str]:
    """A model two ranks can split, and why it is that one: the default model where its
    heads divide by 2, else `bench/tp.py`'s random one (the default's 9 do not)."""
    from bench import tp
    from radixserve.config import DEFAULT_MODEL
    from radixserve.model.config import ModelConfig
    from radixserve.model.loader import resolve_model
    from radixserve.model.shards import ModelShards

    try:
        ModelShards.of(ModelConfig.from_dir(resolve_model(DEFAULT_MODEL)), 0, 2)
        return DEFAULT_MODEL, "the default model"
    except ValueError as e:
        shape = tp.PRESETS["quick"]["shape"]
        return str(tp.model_dir(tp.TINY, shape)), f"random {shape} ({e})"


def section_tp() -> None:
    """`Engine(tp_size=2)` (a rank a GPU, NCCL between them) against `tp_size=1`:
    greedy outputs in float32 (where only the partial sums' order differs), and the
    median decode step of batch 64 x 256-token contexts through rank 0's worker."""
    count = torch.cuda.device_count()
    if count < 2:
        row("tp", "skipped", f"tp_size=2 needs 2 CUDA devices; torch sees {count}")
        return
    import radixserve
    from bench.tp import step_batch

    model, why = tp_model()
    row("tp", "model", model, reason=why)
    prompts = [f"Question {i}: what comes after {i * 13 % 97}? Answer:" for i in range(8)]
    params = {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}
    fb = step_batch(64, 256)
    outs, step_ms = {}, {}
    for tp_size in (1, 2):
        engine = radixserve.Engine(model=model, device="cuda", dtype="float32",
                                   tp_size=tp_size, max_total_tokens=100_000)
        try:
            outs[tp_size] = [r["output_ids"] for r in
                             engine.generate(prompt=prompts, sampling_params=params)]
            engine.flush_cache()  # the steps below write over blocks the cache held
            times = []
            for _ in range(12):
                t0 = time.perf_counter()
                engine.worker.forward(fb)  # returns sampled tokens: the step has finished
                times.append(time.perf_counter() - t0)
            step_ms[tp_size] = statistics.median(times[2:]) * 1e3
        finally:
            engine.shutdown()
        row("tp", f"tp_size={tp_size}: decode step batch 64 x 256 ms", step_ms[tp_size])
    same = sum(a == b for a, b in zip(outs[1], outs[2]))
    row("tp", "greedy outputs identical tp_size=2 vs 1 (fp32)", f"{same}/{len(prompts)}",
        f"{len(prompts)}/{len(prompts)}", same == len(prompts))
    row("tp", "decode step tp_size=2 / tp_size=1", step_ms[2] / step_ms[1])


def section_quantization() -> None:
    """`--quantization int8|q4` has no CUDA kernels wired: a refusal at start-up, before
    the weights load (seconds, not a model load)."""
    import radixserve

    for method in ("int8", "q4"):
        t0 = time.perf_counter()
        try:
            radixserve.Engine(model="smollm2-135m", device="cuda", quantization=method).shutdown()
            refused = "started"
        except ValueError as e:
            refused = str(e)
        ok = "weight-only CPU kernels" in refused
        row("quant", f"{method} on CUDA refused at start-up", ok, "True", ok,
            seconds=time.perf_counter() - t0, message=refused[:200])


def main() -> None:
    parser = argparse.ArgumentParser(description="GPU check of the Triton attention path")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="skip sections that would start after this many seconds")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    import triton
    row("env", "device", torch.cuda.get_device_name(0),
        torch=torch.__version__, triton=triton.__version__)
    results: dict[str, float] = {}
    sections = [("correctness", section_correctness), ("bandwidth", lambda: section_bandwidth(
        results)), ("decode", lambda: section_decode(results)),
        ("gpu_step", lambda: section_gpu_step(args)),
        ("cascade", lambda: section_cascade(results)), ("extend", section_extend),
        ("virtual", section_virtual), ("quant", section_quantization), ("tp", section_tp),
        ("e2e", lambda: section_e2e(args))]
    for name, fn in sections:
        if time.perf_counter() - T0 > args.budget_s - (120 if name == "e2e" else 30):
            row(name, "skipped", "out of time budget", ok=False)
            continue
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - one failure must not hide the rest
            traceback.print_exc()
            row(name, "FAILED", f"{type(exc).__name__}: {str(exc)[:300]}", ok=False)
        torch.cuda.empty_cache()
    print(f"\n{'section':<12} {'check':<58} {'value':<28} {'target':<16} ok")
    for r in ROWS:
        value = f"{r['value']:.4g}" if isinstance(r["value"], float) else str(r["value"])
        ok = "" if r["ok"] is None else ("PASS" if r["ok"] else "FAIL")
        print(f"{r['section']:<12} {r['name'][:58]:<58} {value[:28]:<28} {r['target']:<16} {ok}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump({"rows": ROWS, "total_s": time.perf_counter() - T0}, f, indent=1, default=str)
    print(f"total {time.perf_counter() - T0:.0f}s; json in {args.out}/gpu_check.json")


if __name__ == "__main__":
    main()
