"""End to end on a GPU (issue 43, item 6): the shared-prefix workload through the Engine with
CUDA-graph decode and overlap scheduling each on and off, against transformers' `generate`
on the same model, prompts and card, in one run.

    python bench/gpu/run.py --sections step --model DIR --out $OUT   # a GPU machine
    python bench/gpu/run.py --sections step --tiny --out /tmp/g  # the CPU smoke test's

The workload: 32 requests sharing a 1,400-token prefix (16 own tokens each), 64 new tokens,
greedy, EOS ignored; token ids, so any tokenizer serves. Reported per configuration: output
tok/s, ms per decode step at batch 1/8/32/64 over the workload's context (the time of 40 new
tokens less that of 8, over 32, the prefix cached), the GPU's busy share of the batch-32
decode from the profiler (the kernels' total device time over wall), the graph and eager
step counts, and greedy agreement with graphs off. Writes `gpu_e2e.{json,md}` under
`--out`/e2e, the device named.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import torch

from bench.machine import machine_info, machine_line
from bench.report import save_table
from bench.workloads import greedy, prompts

CONFIGS = {"graphs + overlap": {},
           "graphs, no overlap": {"disable_overlap_schedule": True},
           "overlap, no graphs": {"disable_cuda_graph": True},
           "neither": {"disable_cuda_graph": True, "disable_overlap_schedule": True}}
FULL = dict(requests=32, prefix=1400, own=16, new=64, step_batches=[1, 8, 32, 64])
TINY = dict(requests=4, prefix=40, own=4, new=6, step_batches=[1, 4])


def timed(engine: Any, ids: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    sync()
    start = time.perf_counter()
    results = engine.generate(input_ids=ids, sampling_params=greedy(new))
    sync()
    return time.perf_counter() - start, [r["output_ids"] for r in results]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def busy_share(engine: Any, ids: list[list[int]]) -> float | None:
    """Kernel time over wall time while `ids` decode 16 tokens (None on the CPU)."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall, _ = timed(engine, ids, 16)
    # The kernels' own time summed over every call (an event's `device_time` is per call).
    kernels_us = sum(e.self_device_time_total for e in prof.key_averages()
                     if e.device_type.name == "CUDA")
    return kernels_us / 1e6 / wall


def run_config(name: str, options: dict[str, Any], model: str, shape: dict[str, Any],
               device: str, dtype: str) -> dict[str, Any]:
    import radixserve

    ids = prompts(shape["requests"], shape["prefix"], shape["own"])
    engine = radixserve.Engine(model=model, device=device, dtype=dtype, **options)
    try:
        timed(engine, ids[:1], 2)  # warm, and the prefix cached as in serving
        wall, outputs = timed(engine, ids, shape["new"])
        steps = {}
        for b in shape["step_batches"]:
            batch = prompts(b, shape["prefix"], shape["own"], seed=b)
            timed(engine, batch, 1)  # its prefix cached: the two runs below prefill alike
            short, _ = timed(engine, batch, 8)
            long, _ = timed(engine, batch, 40)
            steps[b] = (long - short) / 32 * 1e3
        busy = busy_share(engine, ids)
        stats = engine.stats()
    finally:
        engine.shutdown()
        gc.collect()  # its pool, before the next configuration sizes its own from free memory
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {"config": name, "options": options, "tok_s": len(ids) * shape["new"] / wall,
            "wall_s": wall, "ms_per_step": steps, "busy_share": busy,
            "graph_steps": stats.get("graph_steps", 0), "eager_steps": stats.get("eager_steps", 0),
            "outputs": outputs}


def transformers_generate(model: str, shape: dict[str, Any], device: str,
                          dtype: torch.dtype) -> dict[str, Any]:
    """The same prompts through transformers' batched `generate` (left-padded)."""
    from transformers import AutoModelForCausalLM

    from radixserve.model.loader import resolve_model

    hf = AutoModelForCausalLM.from_pretrained(resolve_model(model), torch_dtype=dtype,
                                              local_files_only=True).to(device).eval()
    ids = prompts(shape["requests"], shape["prefix"], shape["own"])
    width = max(map(len, ids))
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in ids], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids], device=device)
    with torch.inference_mode():
        hf.generate(input_ids=input_ids[:1], attention_mask=mask[:1], max_new_tokens=2,
                    do_sample=False)
        sync()
        start = time.perf_counter()
        hf.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=shape["new"],
                    min_new_tokens=shape["new"], do_sample=False, pad_token_id=pad)
        sync()
    wall = time.perf_counter() - start
    return {"config": "transformers generate", "tok_s": len(ids) * shape["new"] / wall,
            "wall_s": wall}


def markdown(report: dict[str, Any]) -> str:
    runs, hf = report["runs"], report["transformers"]
    batches = report["shape"]["step_batches"]
    lines = [f"# End to end on `{report['device']}`", "", report["machine"], "",
             f"Model `{report['model']}`, {report['dtype']}; {report['shape']}.", "",
             "| config | out tok/s | x transformers | "
             + " | ".join(f"ms/step @{b}" for b in batches)
             + " | GPU busy | graph / eager steps | greedy = graphs off |",
             "|---|---|---|" + "---|" * len(batches) + "---|---|---|"]
    for r in runs:
        busy = "-" if r["busy_share"] is None else f"{r['busy_share']:.0%}"
        cells = [r["config"], f"{r['tok_s']:.1f}", f"{r['tok_s'] / hf['tok_s']:.2f}x"]
        cells += [f"{r['ms_per_step'][b]:.2f}" for b in batches]
        cells += [busy, f"{r['graph_steps']} / {r['eager_steps']}", r["agreement"]]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(f"| transformers generate | {hf['tok_s']:.1f} | 1.00x |"
                 + " |" * len(batches) + " | | |")
    return "\n".join(lines) + "\n"


def run(out: Path, model: str, tiny: bool = False) -> dict[str, Any]:
    """The whole table, written under `out` (see the module's docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    shape = TINY if tiny else FULL
    runs = [run_config(name, options, model, shape, device, dtype)
            for name, options in CONFIGS.items()]
    reference = next(r for r in runs if r["config"] == "overlap, no graphs")["outputs"]
    for r in runs:
        same = sum(a == b for a, b in zip(r.pop("outputs"), reference))
        r["agreement"] = f"{same}/{len(reference)}"
    hf = transformers_generate(model, shape, device, getattr(torch, dtype))
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu",
              "machine": machine_line(machine_info()), "model": model, "dtype": dtype,
              "shape": shape, "runs": runs, "transformers": hf}
    save_table(report, out / "gpu_e2e", markdown(report))
    return report
