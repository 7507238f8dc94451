"""Multi-LoRA serving (issue 46): a shared-prefix workload under 1, 4 and 16 adapters
against the base model alone, and against PEFT's own `generate`, on the CPU.

    python bench/lora.py --preset quick   # batch 32 over a 256-token shared prompt
    python bench/lora.py --preset tiny --out /tmp/lora   # a tiny random model (CI smoke)

Adapters are made by PEFT here (random A and B, rank `rank` on `targets`). The workload:
`batch` requests sharing a `prefix`-token prompt (cached first, as a system prompt is in
serving), `own` tokens of their own, `new` greedy tokens, EOS ignored; with adapters, the
requests take them in turn (request i runs adapter i mod n). Each configuration is an
Engine of its own, one after the other on the same machine: the base model alone (LoRA
serving off), then 1, 4 and 16 adapters (`max_loras_per_batch` 16, so none waits), the
round repeated `rounds` times and each configuration's best kept (a shared machine's
bandwidth moves minute to minute; the copy and read bandwidth are measured before); then
transformers + PEFT's batched `generate` under 4 adapters (`adapter_names`, PEFT's mixed
batch), the same prompts left-padded. Output tok/s of each, as ratios to the base alone;
the PEFT row checks that its greedy outputs equal the Engine's. Writes
`bench/results/lora_<preset>.{json,md}`.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.workloads import greedy, prompts  # noqa: E402
from bench.machine import machine_info, machine_line, measure_limits, preset_args  # noqa: E402
from bench.report import save_table  # noqa: E402
from radixserve.config import DEFAULT_MODEL  # noqa: E402

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(batch=8, prefix=32, own=4, new=6, rank=8, adapters=(1, 4), rounds=1,
                 tiny=True),
    "quick": dict(batch=32, prefix=256, own=16, new=32, rank=16, adapters=(1, 4, 16),
                  rounds=3),
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
PEFT_ADAPTERS = 4


def run_engine(model: str, paths: dict[str, Path], shape: dict[str, Any]) -> dict[str, Any]:
    import radixserve

    ids = prompts(shape["batch"], shape["prefix"], shape["own"])
    names = list(paths) or [None]
    which = [names[i % len(names)] for i in range(len(ids))]
    tokens = shape["batch"] * (shape["prefix"] + shape["own"] + shape["new"] + 16)
    options: dict[str, Any] = dict(device="cpu", max_running_requests=shape["batch"],
                                   max_total_tokens=2 * tokens)
    if paths:
        options.update(lora_paths=[f"{n}={p}" for n, p in paths.items()],
                       max_loras_per_batch=max(8, len(paths)), max_loaded_loras=max(8, len(paths)))
    engine = radixserve.Engine(model=model, **options)
    try:  # each adapter's prefix cached, as a system prompt is
        engine.generate(input_ids=[ids[0]] * len(names), sampling_params=greedy(1), lora_name=names)
        start = time.perf_counter()
        results = engine.generate(input_ids=ids, sampling_params=greedy(shape["new"]),
                                  lora_name=which)
        seconds = time.perf_counter() - start
    finally:
        engine.shutdown()
    return {"adapters": len(paths), "seconds": seconds,
            "tok_s": len(ids) * shape["new"] / seconds,
            "outputs": [r["output_ids"] for r in results], "which": which}


def run_peft(model: str, paths: dict[str, Path], shape: dict[str, Any]) -> dict[str, Any]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = prompts(shape["batch"], shape["prefix"], shape["own"])
    names = list(paths)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, local_files_only=True)
    peft = PeftModel.from_pretrained(base, paths[names[0]], adapter_name=names[0])
    for name in names[1:]:
        peft.load_adapter(paths[name], adapter_name=name)
    peft.eval()
    which = [names[i % len(names)] for i in range(len(ids))]
    width = max(map(len, ids))
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
    with torch.inference_mode():
        start = time.perf_counter()
        out = peft.generate(input_ids=input_ids, attention_mask=mask, adapter_names=which,
                            max_new_tokens=shape["new"], min_new_tokens=shape["new"],
                            do_sample=False)
        seconds = time.perf_counter() - start
    return {"adapters": len(names), "seconds": seconds,
            "tok_s": len(ids) * shape["new"] / seconds,
            "outputs": out[:, width:].tolist(), "which": which}


def make_adapters(model: str, n: int, shape: dict[str, Any], root: Path) -> dict[str, Path]:
    from tests.lora.adapters import peft_adapter

    return {f"a{i}": peft_adapter(Path(model), root, rank=shape["rank"], alpha=2 * shape["rank"],
                                  targets=TARGETS, seed=i) for i in range(n)}


def markdown(report: dict[str, Any]) -> str:
    s, runs = report["shape"], report["runs"]
    base = runs[0]["tok_s"]
    lines = [f"# Multi-LoRA serving: preset `{report['preset']}`", "",
             report["machine"] + f". Model `{report['model']}`, float32. Best of "
             f"{s['rounds']} interleaved rounds (all: {report['all_rounds_s']} s).", "",
             f"{s['batch']} requests sharing a {s['prefix']}-token prompt (cached first), "
             f"{s['own']} own tokens each, {s['new']} new greedy tokens; adapters of rank "
             f"{s['rank']} on {', '.join(TARGETS)}, taken in turn by the requests.", "",
             "| configuration | adapters | seconds | out tok/s | vs base alone |",
             "|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['name']} | {r['adapters']} | {r['seconds']:.2f} | "
                     f"{r['tok_s']:.1f} | {r['tok_s'] / base:.2f}x |")
    four = next((r for r in runs if r["name"] == "radixserve" and r["adapters"] == 4), None)
    peft = runs[-1]
    if four is not None:
        lines += ["", f"4 adapters vs the base alone: **{four['tok_s'] / base:.2f}x** "
                  "(goal >= 0.8x); vs PEFT's generate under the same 4 adapters: "
                  f"**{four['tok_s'] / peft['tok_s']:.1f}x**; PEFT's greedy outputs equal "
                  f"radixserve's: {report['agreement']}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = preset_args(__doc__ or "", PRESETS, DEFAULT_MODEL)
    shape = PRESETS[args.preset]
    model = args.model
    if shape.get("tiny"):
        from tests.factories import tiny_model_dir

        model = str(tiny_model_dir(args.out / "models", num_layers=2, hidden_size=64))
    else:
        from radixserve.model.loader import resolve_model

        model = str(resolve_model(model))
    machine = machine_info()
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(model, max(shape["adapters"]), shape, Path(tmp))
        limits = measure_limits(quick=True)
        configs = [{}] + [dict(list(adapters.items())[:n]) for n in shape["adapters"]]
        rounds = [[run_engine(model, paths, shape) for paths in configs]
                  for _ in range(shape["rounds"])]
        runs = [{"name": "radixserve" if i else "base alone",
                 **min((r[i] for r in rounds), key=lambda run: run["seconds"])}
                for i in range(len(configs))]
        peft_paths = dict(list(adapters.items())[:PEFT_ADAPTERS])
        runs.append({"name": "transformers + PEFT", **run_peft(model, peft_paths, shape)})
    ours = next(r for r in runs if r["adapters"] == min(PEFT_ADAPTERS, max(shape["adapters"]))
                and r["name"] == "radixserve")
    same = sum(a == b for a, b in zip(ours["outputs"], runs[-1]["outputs"]))
    for r in (*runs, *(run for round_ in rounds for run in round_)):
        r.pop("outputs", None), r.pop("which", None)
    report = {"preset": args.preset, "model": model, "shape": shape, "limits": limits,
              "all_rounds_s": [[round(run["seconds"], 2) for run in r] for r in rounds],
              "machine": machine_line(machine, torch.get_num_threads()) + ", copy "
              f"{limits['copy_gbs']:.1f} GB/s, read {limits['read_gbs']:.1f} GB/s",
              "machine_info": machine, "runs": runs, "agreement": f"{same}/{shape['batch']}"}
    save_table(report, args.out / f"lora_{args.preset}", markdown(report))


if __name__ == "__main__":
    main()
