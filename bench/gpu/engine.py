"""bench/gpu/run.py's engine sections: the virtual KV layout on CUDA VMM, tensor parallelism
over 2 GPUs, the Engine end to end with each attention backend, and the GPU step (CUDA
graphs and overlap, bench/gpu/step.py)."""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.gpu.timing import cuda_time, rel, row


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


def section_virtual(model: str) -> None:
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
        engine = radixserve.Engine(model=model, device="cuda", dtype="bfloat16",
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


def section_e2e(model: str) -> None:
    import radixserve

    prefix = ("You are a careful assistant. Use the facts below.\n" + " ".join(
        f"Fact {i}: item {i} costs {i * 7 % 101} coins." for i in range(120)) + "\n")
    prompts = [prefix + f"Question: how many coins does item {i} cost?" for i in range(33)]
    params = {"max_new_tokens": 64, "temperature": 0.0}
    outs: dict[str, list[dict[str, Any]]] = {}
    for backend in ("triton", "torch"):
        t0 = time.perf_counter()
        engine = radixserve.Engine(model=model, device="cuda", dtype="bfloat16",
                                   attention_backend=backend)
        try:
            load_s = time.perf_counter() - t0
            batch = prompts if backend == "triton" else prompts[:9]
            engine.generate(prompt=[batch[0]], sampling_params=params)  # warm + cache prefix
            t1 = time.perf_counter()
            res = engine.generate(prompt=batch[1:], sampling_params=params)
            wall = time.perf_counter() - t1
        finally:
            engine.shutdown()
        res = [res] if isinstance(res, dict) else list(res)
        outs[backend] = res
        cached = sum(r["meta_info"]["cached_tokens"] for r in res)
        prompt_toks = sum(r["meta_info"]["prompt_tokens"] for r in res)
        gen_toks = sum(r["meta_info"]["completion_tokens"] for r in res)
        row("e2e", f"{backend}: cached/prompt tokens", cached / max(prompt_toks, 1),
            "> 0.8", cached / max(prompt_toks, 1) > 0.8, load_s=load_s, wall_s=wall)
        row("e2e", f"{backend}: {len(res)} requests, output tok/s", gen_toks / wall,
            sample=res[0].get("text", "")[:120])
    n = len(outs["torch"])
    same = sum(a["output_ids"] == b["output_ids"]
               for a, b in zip(outs["triton"][:n], outs["torch"]))
    row("e2e", "greedy outputs identical triton vs torch (bf16)", f"{same}/{n}")


def section_gpu_step(args: argparse.Namespace, model: str) -> None:
    from bench.gpu import step

    report = step.run(Path(args.out) / "e2e", model, args.tiny)
    hf = report["transformers"]["tok_s"]
    row("gpu_step", "transformers generate, output tok/s", hf)
    for r in report["runs"]:
        name = r["config"]
        row("gpu_step", f"{name}: output tok/s x transformers", r["tok_s"] / hf, ">= 20",
            r["tok_s"] / hf >= 20, tok_s=r["tok_s"])
        batch = 32 if 32 in r["ms_per_step"] else max(r["ms_per_step"])  # --tiny: 1 and 4
        row("gpu_step", f"{name}: ms per decode step at batch {batch}",
            r["ms_per_step"][batch], "<= 2", r["ms_per_step"][batch] <= 2,
            ms_per_step=r["ms_per_step"])
        row("gpu_step", f"{name}: GPU busy share at batch 32", r["busy_share"], ">= 0.6",
            r["busy_share"] is not None and r["busy_share"] >= 0.6)
        row("gpu_step", f"{name}: greedy = graphs off", r["agreement"],
            graph_steps=r["graph_steps"], eager_steps=r["eager_steps"])


def section_tp() -> None:
    """`Engine(tp_size=2)` (a rank a GPU, NCCL between them) against `tp_size=1`:
    greedy outputs in float32 (where only the partial sums' order differs), and the
    median decode step of batch 64 x 256-token contexts through rank 0's worker."""
    count = torch.cuda.device_count()
    if count < 2:
        row("tp", "skipped", f"tp_size=2 needs 2 CUDA devices; torch sees {count}")
        return
    import radixserve
    from bench import tp

    # Random weights of bench/tp.py's shape: the default model's 9 heads do not split in 2.
    model = str(tp.model_dir(tp.TINY, tp.PRESETS["quick"]["shape"]))
    prompts = [f"Question {i}: what comes after {i * 13 % 97}? Answer:" for i in range(8)]
    params = {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}
    fb = tp.step_batch(64, 256)
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
