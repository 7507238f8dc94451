"""`--quantization none | int8 | q4` on the default model: decode speed against the
weight-read floor, and agreement with the fp32 model of the same (dequantized) weights.

    python bench/quant.py --preset quick    # speed + agreement, ~5 minutes on 2 cores
    python bench/quant.py --preset speed    # speed only
    python bench/quant.py --preset layers   # batch 1, native layers on/off (issue 57)
    python bench/quant.py --preset extends  # the same, steps of 6 new tokens a sequence

Speed: one Worker per method, decode steps at batch 1 and 8 (each sequence `context`
tokens deep), the methods interleaved round by round (the machine may be shared: a figure is
the median over rounds). Beside each: the bytes a step reads (projection weights in their
format, the LM head in its format, the KV), the floor those bytes take at the read
bandwidth measured in the same run, and the LM head's own time. Then the projections alone
per format (dense fp32 in oneDNN's layout, and the int8 and q4 kernels), against the floor
of their own bytes.

Agreement: the Engine on each method against transformers fp32 on the converted model (the
GGUF's blocks dequantized, the weights `q4` holds): greedy tokens on chat prompts (plain
questions, a long system prompt, few-shot, multi-turn, an agent's tool format), with the
reference's top-2 logit gap where they first differ; prompt logprobs; teacher-forced top-1
agreement and perplexity on a text. Writes `bench/results/quant_<preset>.{json,md}`.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cascade_decode import blocks_needed, decode_batch
from bench.machine import machine_info, machine_line, measure_limits, preset_args
from bench.report import save_table
import radixserve.native as native
from radixserve.config import DEFAULT_MODEL, EngineConfig
from radixserve.model.loader import load_tokenizer, resolve_model
from radixserve.model.llama import silu_mul
from radixserve.model.native_layers import NativeLayers
from radixserve.worker.worker import Worker

METHODS = ("none", "int8", "q4")
PRESETS: dict[str, dict[str, Any]] = {
    "quick": dict(batches=[1, 8], context=512, rounds=7, steps=3, agreement=True, new=32),
    "speed": dict(batches=[1, 8], context=512, rounds=9, steps=3, agreement=False, new=32),
    # fp32 and q4, each with a step's layers in one native call and as modules, alternated.
    "layers": dict(batches=[1], context=512, rounds=15, steps=5, agreement=False, new=32,
                   methods=("none", "q4"), layers=True),
    "extends": dict(batches=[1, 4], context=512, rounds=9, steps=5, agreement=False, new=32,
                    methods=("none", "q4"), layers=True, rows=6),  # a prompt's last 6 tokens
}
TEXT = (
    "The history of the bicycle began in the early nineteenth century, when inventors in "
    "Germany and France built wooden machines that riders pushed along with their feet. "
    "Pedals came later, fixed to the front wheel, and the high-wheeled bicycles of the "
    "1870s followed, fast but dangerous. The safety bicycle, with two wheels of equal size "
    "and a chain driving the rear one, made cycling popular with everyone, and pneumatic "
    "tyres soon made it comfortable. Within a few decades bicycles carried workers to "
    "factories, soldiers to the front and families to the countryside on Sundays."
)
FEW_SHOT = ("Q: What is the plural of mouse?\nA: mice\nQ: What is the plural of child?\n"
            "A: children\nQ: What is the plural of goose?\nA:")
AGENT = ("You are an agent with tools. To call one, answer with one line of JSON: "
         '{"tool": NAME, "args": {...}}. Tools: search(query), calculator(expression), '
         "weather(city). Answer only with the call.")


def prompts(tokenizer) -> list[list[int]]:
    def chat(messages: list[dict[str, str]]) -> list[int]:
        return tokenizer.encode(tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True))

    questions = ["What is the capital of France?", "Write a haiku about the sea.",
                 "Explain photosynthesis in one sentence.", "List three prime numbers.",
                 "Why is the sky blue? Answer briefly.", "Give me a synonym for happy."]
    out = [chat([{"role": "user", "content": q}]) for q in questions]
    out.append(chat([{"role": "system", "content": TEXT},
                     {"role": "user", "content": "When did pedals appear?"}]))
    out.append(chat([{"role": "user", "content": FEW_SHOT}]))
    out.append(chat([{"role": "user", "content": "Hi! I am planning a trip to Rome."},
                     {"role": "assistant", "content": "Great choice! How can I help?"},
                     {"role": "user", "content": "What should I see on the first day?"}]))
    out.append(chat([{"role": "system", "content": AGENT},
                     {"role": "user", "content": "What is 17 times 23?"}]))
    out.append(tokenizer.encode(FEW_SHOT))
    out.append(tokenizer.encode(TEXT[:200]))
    return out


@torch.inference_mode()
def reference(model, ids: list[int], new: int) -> tuple[list[int], list[float], torch.Tensor]:
    """transformers' greedy tokens, top-2 gaps, and log-softmax over prompt + output."""
    seq = list(ids)
    tokens, gaps = [], []
    for _ in range(new):
        logits = model(torch.tensor([seq])).logits[0, -1]
        top = logits.topk(2).values
        tokens.append(int(logits.argmax()))
        gaps.append(float(top[0] - top[1]))
        seq.append(tokens[-1])
    return tokens, gaps, torch.log_softmax(model(torch.tensor([seq])).logits[0], -1)


def agreement(model: str, model_dir: Path, new: int) -> dict[str, Any]:
    """`model` by name (a GGUF's q4 takes the file's blocks; its converted directory
    `model_dir` would be quantized from floats) against transformers on `model_dir`."""
    from transformers import AutoModelForCausalLM

    from radixserve import Engine

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                              local_files_only=True).eval()
    tok = load_tokenizer(model_dir)
    cases = prompts(tok)
    refs = [reference(hf, ids, new) for ids in cases]
    text_ids = tok.encode(TEXT)
    with torch.inference_mode():
        text_ref = torch.log_softmax(hf(torch.tensor([text_ids])).logits[0], -1)
    out: dict[str, Any] = {}
    for method in METHODS:
        with Engine(model, quantization=method, max_total_tokens=8192,
                    enable_prefix_cache=False) as engine:
            results = engine.generate(input_ids=cases, sampling_params={
                "max_new_tokens": new, "temperature": 0, "ignore_eos": True},
                return_logprob=True, logprob_start_len=0)
            text = engine.generate(input_ids=text_ids, sampling_params={"max_new_tokens": 1},
                                   return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
        first, lp_err = [], []
        for (tokens, gaps, ref_lp), res in zip(refs, results):
            got = res["output_ids"]
            diff = next((i for i, (a, b) in enumerate(zip(got, tokens)) if a != b), None)
            if diff is not None:
                first.append({"index": diff, "reference_gap": gaps[diff]})
            lp_err += [abs(lp - float(ref_lp[k - 1, t])) for k, (lp, t, _) in
                       enumerate(res["meta_info"]["input_token_logprobs"]) if k > 0]
        meta = text["meta_info"]
        lps = [lp for lp, _, _ in meta["input_token_logprobs"][1:]]
        top1 = [top[0][1] for top in meta["input_top_logprobs"][1:]]
        want = text_ref[:-1].argmax(-1).tolist()
        ppl_ref = math.exp(-statistics.fmean(
            float(text_ref[k, t]) for k, t in enumerate(text_ids[1:])))
        out[method] = {
            "prompts": len(cases), "identical": len(cases) - len(first), "first_divergence": first,
            "prompt_logprob_max_err": max(lp_err), "prompt_logprob_median_err":
                statistics.median(lp_err),
            "teacher_forced_top1": sum(a == b for a, b in zip(top1, want)) / len(want),
            "perplexity": math.exp(-statistics.fmean(lps)), "perplexity_fp32": ppl_ref}
    return out


@torch.inference_mode()
def speed(model: str, model_dir: Path, preset: dict[str, Any],
          read_gbs: float) -> list[dict[str, Any]]:
    context, batches, new = preset["context"], preset["batches"], preset.get("rows", 1)
    shapes = {b: dict(batch=b, groups=b, prefix=0, suffix=context - new, new=new) for b in batches}
    tokens = max(blocks_needed(**s) for s in shapes.values()) * 16
    methods = preset.get("methods", METHODS)
    workers = {m: Worker(EngineConfig(model=model, quantization=m, max_total_tokens=tokens),
                         model_dir) for m in methods}
    mc = workers["none"].model_config
    layers = {m: NativeLayers.of(w.model, silu_mul) for m, w in workers.items()}
    variants = [(m, on) for m in methods for on in ((True, False) if preset.get("layers")
                                                    else (True,))]
    kv_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 4
    label = {(m, on): m if on else f"{m}, modules" for m, on in variants}
    times: dict[tuple[str, int], list[float]] = {(label[v], b): [] for v in variants
                                                 for b in batches}
    head: dict[tuple[str, int], list[float]] = {k: [] for k in times}
    for _ in range(preset["rounds"] + 1):  # the first round warms every path up
        for b in batches:
            fb = decode_batch(**shapes[b])
            x = torch.randn(b, mc.hidden_size)
            for m, on in variants:
                w = workers[m]
                w.model._native = layers[m] if on else None
                runs = []
                for _ in range(preset["steps"]):
                    start = time.perf_counter()
                    w.forward(fb)
                    runs.append(time.perf_counter() - start)
                times[label[m, on], b].append(statistics.median(runs) * 1e3)
                start = time.perf_counter()
                w.model.packed_head.matmul(x, None)
                head[label[m, on], b].append((time.perf_counter() - start) * 1e3)
    rows = []
    for (m, b), ms in times.items():
        report = workers[m.split(",")[0]].quantization
        weights = report.weight_bytes + report.head_bytes
        read = weights + b * context * kv_per_token
        step = statistics.median(ms[1:])
        rows.append({"method": m, "batch": b, "context": context, "step_ms": step, "rows": new,
                     "ms_per_token": step / b / new, "head_ms": statistics.median(head[m, b][1:]),
                     "projection_mb": report.weight_bytes / 1e6,
                     "head_mb": report.head_bytes / 1e6, "read_mb": read / 1e6,
                     "floor_ms": read / read_gbs / 1e6})
    base = {r["batch"]: r["step_ms"] for r in rows if r["method"] == "none"}
    modules = {(r["method"], r["batch"]): r["step_ms"] for r in rows}
    for r in rows:  # x_modules: the native layers' gain over the modules, in the same rounds
        r["speedup"] = base[r["batch"]] / r["step_ms"]
        r["of_floor"] = r["floor_ms"] / r["step_ms"]
        r["x_modules"] = modules.get((f"{r['method']}, modules", r["batch"]), r["step_ms"]) \
            / r["step_ms"]
    return rows


@torch.inference_mode()
def kernel_paths(model_dir: Path, batches: list[int], rounds: int,
                 read_gbs: float) -> list[dict[str, Any]]:
    """The model's projections alone (every layer's shapes, random weights) per format,
    beside the time their bytes take at the measured read bandwidth."""
    from radixserve.model.config import ModelConfig
    from radixserve.model.linear import F32Weight
    from radixserve.model.quant.groups import Groups
    from radixserve.model.quant.int4 import Int4Weight
    from radixserve.model.quant.int8 import Int8Weight

    mc = ModelConfig.from_dir(model_dir)
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    shapes = [(q + 2 * kv, mc.hidden_size), (mc.hidden_size, q),
              (2 * mc.intermediate_size, mc.hidden_size), (mc.hidden_size, mc.intermediate_size)]
    weights = [torch.randn(n, k) * 0.02 for n, k in shapes * mc.num_layers]
    paths = {"dense": [F32Weight(w) for w in weights],
             "int8": [Int8Weight(Groups.quantize(w, 8)) for w in weights],
             "q4": [Int4Weight(Groups.quantize(w, 4)) for w in weights]}
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds + 1):
        for b in batches:
            xs = {k: torch.randn(b, k) for _, k in shapes}
            for fmt, layer in paths.items():
                start = time.perf_counter()
                for w, (_, k) in zip(layer, shapes * mc.num_layers):
                    w.matmul(xs[k], None)
                times.setdefault((fmt, b), []).append((time.perf_counter() - start) * 1e3)
    out = []
    for (fmt, b), ms in times.items():
        floor = sum(w.nbytes for w in paths[fmt]) / read_gbs / 1e6
        step = statistics.median(ms[1:])
        out.append({"format": fmt, "batch": b, "ms": step, "floor_ms": floor,
                    "of_floor": floor / step})
    return out


def markdown(report: dict[str, Any]) -> str:
    m, lim = report["machine"], report["limits"]
    lines = [f"# `--quantization`: preset `{report['preset']}`", "",
             machine_line(m, m["torch_threads"]) + " (a machine shared with other work: "
             "methods interleaved, medians over rounds). "
             f"Model `{report['model']}`. Measured read bandwidth (same run): "
             f"{lim['read_gbs']:.1f} GB/s; fp32 matmul {lim['matmul_gflops']:.0f} GFLOP/s.", "",
             "| method | batch x tokens | step ms | ms/token | x none | x modules | projections MB "
             "| LM head MB | LM head ms | read MB/step | floor ms | floor/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(report["speed"], key=lambda r: (r["batch"], r["method"])):
        lines.append(f"| {r['method']} | {r['batch']} x {r.get('rows', 1)} | {r['step_ms']:.1f} | "
                     f"{r['ms_per_token']:.2f} | {r['speedup']:.2f} | "
                     f"{r.get('x_modules', 1.0):.2f} | {r['projection_mb']:.0f} | "
                     f"{r['head_mb']:.0f} | {r['head_ms']:.1f} | {r['read_mb']:.0f} | "
                     f"{r['floor_ms']:.1f} | {r['of_floor']:.0%} |")
    lines += ["", "Projections alone (all layers' shapes, random weights, fp32 activations), ms "
              "per step and the read floor of their bytes:", "",
              "| format | batch | ms | floor ms | floor/step |", "|---|---|---|---|---|"
              ] if report["kernels"] else []
    for r in sorted(report["kernels"], key=lambda r: (r["batch"], r["format"])):
        lines.append(f"| {r['format']} | {r['batch']} | {r['ms']:.1f} | {r['floor_ms']:.1f} | "
                     f"{r['of_floor']:.0%} |")
    if report.get("agreement"):
        lines += ["", f"Agreement with transformers fp32 on the same dequantized weights "
                  f"({report['new_tokens']} greedy tokens per prompt):", "",
                  "| method | identical | first divergences (index, reference top-2 gap) "
                  "| prompt logprob max / median err | teacher-forced top-1 | perplexity "
                  "(fp32) |", "|---|---|---|---|---|---|"]
        for method, a in report["agreement"].items():
            div = ", ".join(f"{d['index']} ({d['reference_gap']:.3f})"
                            for d in a["first_divergence"]) or "-"
            lines.append(f"| {method} | {a['identical']}/{a['prompts']} | {div} | "
                         f"{a['prompt_logprob_max_err']:.2e} / "
                         f"{a['prompt_logprob_median_err']:.2e} | {a['teacher_forced_top1']:.1%} "
                         f"| {a['perplexity']:.3f} ({a['perplexity_fp32']:.3f}) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    args = preset_args(__doc__ or "", PRESETS, DEFAULT_MODEL, threads=True)
    preset = PRESETS[args.preset]
    model_dir = resolve_model(args.model)
    machine = machine_info()
    limits = measure_limits()
    report: dict[str, Any] = {"preset": args.preset, "model": args.model, "machine": machine,
                              "limits": limits, "new_tokens": preset["new"],
                              "speed": speed(args.model, model_dir, preset, limits["read_gbs"]),
                              "kernels": [] if preset.get("layers") else kernel_paths(
                                  model_dir, preset["batches"], 3, limits["read_gbs"])}
    if preset["agreement"]:
        report["agreement"] = agreement(args.model, model_dir, preset["new"])
    isa = "" if native.ARCH == "native" else f"_{native.load().isa()}"  # an AVX2 build here
    save_table(report, args.out / f"quant_{args.preset}{isa}", markdown(report))


if __name__ == "__main__":
    main()
