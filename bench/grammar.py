"""Grammar backends for constrained decoding: outlines-core against xgrammar, and what
constrained decoding costs the Engine at batch 32.

Library part (the default model's tokenizer, no weights):
- set-up: each library's view of the 49k-token vocabulary;
- compile, cold (median of `--repeats` fresh compilers) and cached (the runtime's LRU), for
  four JSON schemas (flat object; nested with arrays, enums, anyOf; tool-call arguments; a
  big order document with $defs, arrays of objects and 16 optional fields) and nine regexes
  (the DSL's dtype patterns, `\\w+`, emails, timestamps, ...);
- the per-step mask cost along a valid output (the example, tokenized as the model would):
  for xgrammar the runtime's own step (`GrammarState.advance` + `mask`); for outlines-core
  the step of its former home in the runtime (next DFA state, allowed tokens, packed
  bitmap), paid once per DFA state and then cached.
xgrammar goes through the runtime's `GrammarCompiler` (compact JSON, as served); outlines-core
through the adapter in bench/grammar_outlines.py (its JSON whitespace limited to one optional
space, the nearest to compact).

Engine part: 32 sampled requests at once, unconstrained and constrained (a JSON schema and a
regex that cannot finish within max_new_tokens, with ignore_eos, so every request runs the
same length in every mode), interleaved and repeated; output tokens per second and per
CPU-second (the machine may be shared), the scheduler's time per step (where masks are
filled) and the worker's (where they are applied), and the constrained / unconstrained
ratios. Also the worker's `apply_masks` alone at batch 32.

    python bench/grammar.py [--repeats 3] [--batch 32] [--new-tokens 48]
                            [--engine-repeats 5] [--skip-engine]

Writes bench/results/grammar.{json,md} with the commit and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.grammar_outlines import Outlines, timed  # noqa: E402
from bench.machine import machine_info  # noqa: E402
from bench.report import save_table  # noqa: E402
from radixserve.config import DEFAULT_MODEL  # noqa: E402
from radixserve.model.loader import load_tokenizer, resolve_model  # noqa: E402
from radixserve.scheduler.grammar import GrammarState  # noqa: E402
from radixserve.scheduler.grammar_compiler import GrammarCompiler  # noqa: E402
from radixserve.front_door.requests import eos_token_ids  # noqa: E402

STRING = {"type": "string"}
ADDRESS = {"type": "object", "properties": {
    "street": STRING, "city": STRING, "zip": {"type": "string", "pattern": "[0-9]{5}"},
    "country": {"enum": ["FR", "DE", "IT", "ES", "NL", "BE", "PT", "AT"]}},
    "required": ["street", "city", "zip", "country"]}
SCHEMAS: dict[str, tuple[dict, dict]] = {
    # name: (schema, an instance in schema order, which both backends must accept)
    "flat object": (
        {"type": "object", "properties": {"name": STRING, "age": {"type": "integer"},
                                          "email": STRING, "active": {"type": "boolean"}},
         "required": ["name", "age", "email", "active"]},
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "active": True}),
    "nested, arrays/enums/anyOf": (
        {"type": "object", "properties": {
            "name": STRING, "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "role": {"enum": ["admin", "user", "guest"]}, "address": ADDRESS,
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
            "manager": {"anyOf": [{"type": "null"}, {"type": "integer"}]}},
         "required": ["name", "age", "role", "address", "tags", "manager"]},
        {"name": "Grace", "age": 45, "role": "admin",
         "address": {"street": "1 Quai Voltaire", "city": "Paris", "zip": "75007",
                     "country": "FR"}, "tags": ["red", "blue"], "manager": None}),
    "tool-call arguments": (
        {"type": "object", "properties": {
            "location": {"type": "string", "description": "City and country"},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "include": {"type": "array", "items": {"enum": ["humidity", "wind", "uv"]}}},
         "required": ["location", "unit", "days", "include"]},
        {"location": "Lyon, France", "unit": "celsius", "days": 3,
         "include": ["wind", "uv"]}),
    "big (order, $defs, 16 optional)": (
        {"type": "object", "$defs": {"address": ADDRESS, "item": {
            "type": "object", "properties": {
                "sku": {"type": "string", "pattern": "[A-Z]{3}-[0-9]{4}"},
                "qty": {"type": "integer", "minimum": 1, "maximum": 100},
                "price": {"type": "number"}, "gift": {"type": "boolean"}},
            "required": ["sku", "qty", "price", "gift"]}},
         "properties": {
            "id": {"type": "string", "pattern": "[0-9a-f]{8}"},
            "customer": {"type": "object", "properties": {
                "name": STRING, "email": STRING, "phone": STRING},
                "required": ["name", "email", "phone"]},
            "items": {"type": "array", "items": {"$ref": "#/$defs/item"}},
            "billing": {"$ref": "#/$defs/address"}, "shipping": {"$ref": "#/$defs/address"},
            "status": {"enum": ["new", "paid", "packed", "shipped", "delivered", "returned",
                                "cancelled", "refunded"]},
            **{f"note{i:02d}": [STRING, {"type": "integer"}, {"type": "boolean"},
                                {"type": "number"}][i % 4] for i in range(16)}},
         "required": ["id", "customer", "items", "billing", "shipping", "status"]},
        {"id": "0badf00d", "customer": {"name": "Lin", "email": "lin@example.com",
                                        "phone": "+33 1 23 45 67 89"},
         "items": [{"sku": "ABC-0042", "qty": 2, "price": 9.5, "gift": False},
                   {"sku": "XYZ-1000", "qty": 1, "price": 120.0, "gift": True}],
         "billing": {"street": "2 Rue Cler", "city": "Paris", "zip": "75007", "country": "FR"},
         "shipping": {"street": "9 Via Roma", "city": "Torino", "zip": "10121",
                      "country": "IT"},
         "status": "paid", "note03": 2.5, "note10": True}),
}
REGEXES: dict[str, tuple[str, str]] = {
    "dtype int": (r"[-+]?[0-9]+[ \n]*", "330"),
    "dtype float": (r"[-+]?[0-9]*\.?[0-9]+[ \n]*", "-12.75"),
    "dtype bool": (r"(True|False)", "False"),
    "dtype str": (r"\"[\w\d\s]*\"", '"hello world 42"'),
    "answer": (r"(yes|no), [0-9]{1,3} m", "yes, 330 m"),
    r"\w+": (r"\w+", "Constrained_decoding42"),
    "email": (r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}", "jane.doe@example.com"),
    "timestamp": (r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z",
                  "2024-05-01T12:30:00Z"),
    "phone": (r"\(\d{3}\) \d{3}-\d{4}", "(555) 123-4567"),
}
ENGINE_SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "notes": {"type": "array", "items": STRING, "minItems": 64}}, "required": ["title", "notes"]}
"""Cannot be completed within the engine part's max_new_tokens: every request runs to its
length, so the modes compare equal work."""
ENGINE_REGEX = r"([A-Za-z]+[ ,.])+[A-Za-z]+\."
QUESTIONS = ["Take notes on the history of Paris.", "List facts about octopuses.",
             "Summarise how a bicycle works.", "Write notes on the water cycle.",
             "Describe a good breakfast.", "Note the rules of chess.",
             "Give tips for learning a language.", "Explain how bread rises."]


def compact(instance: Any) -> str:
    return json.dumps(instance, separators=(", ", ": "))


def micros(seconds: list[float]) -> dict[str, float]:
    us = [1e6 * s for s in seconds]
    return {"mean_us": statistics.fmean(us), "p50_us": float(np.percentile(us, 50)),
            "p99_us": float(np.percentile(us, 99)), "max_us": max(us), "steps": len(us)}


def xgrammar_walk(grammar: Any, tokens: list[int]) -> tuple[list[float], bool]:
    state, first = timed(lambda: GrammarState(grammar, ignore_eos=False))
    times = [first]
    for token in tokens:
        start = time.perf_counter()
        state.advance(token)
        state.mask()
        times.append(time.perf_counter() - start)
    return times[:-1], not state.broken and state.accepted


def library_part(model_dir: Path, repeats: int) -> dict[str, Any]:
    import xgrammar  # noqa: F401  (imported once here, so no compile below pays for it)

    tokenizer = load_tokenizer(model_dir)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    eos_ids = eos_token_ids(tokenizer, model_dir)  # as the Engine's scheduler takes them
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731

    def fresh_xgrammar() -> GrammarCompiler:
        compiler = GrammarCompiler(model_dir, vocab_size, eos_ids)
        compiler.compile("regex", "a")  # vocabulary set-up, not counted as a compile
        return compiler

    setup = {"xgrammar": timed(fresh_xgrammar)[1],
             "outlines-core": timed(lambda: Outlines(model_dir, vocab_size, eos_ids))[1]}
    outlines = Outlines(model_dir, vocab_size, eos_ids)
    cases = ([("json_schema", name, json.dumps(s), compact(x)) for name, (s, x) in SCHEMAS.items()]
             + [("regex", name, r, x) for name, (r, x) in REGEXES.items()])
    rows = []
    for kind, name, text, example in cases:
        tokens = encode(example)
        row: dict[str, Any] = {"kind": kind, "name": name, "example_tokens": len(tokens)}
        cold, grammar = [], None
        for _ in range(repeats):
            compiler = fresh_xgrammar()
            grammar, seconds = timed(lambda: compiler.compile(kind, text))  # noqa: B023
            cold.append(seconds)
        row["xgrammar"] = {"cold_ms": 1e3 * statistics.median(cold),
                           "cached_us": 1e6 * timed(lambda: compiler.compile(kind, text))[1],  # noqa: B023
                           "grammar_kib": grammar.compiled.memory_size_bytes / 1024}
        times, ok = xgrammar_walk(grammar, tokens)
        row["xgrammar"].update(step=micros(times), accepted=ok)
        cold = [timed(lambda: outlines.compile(kind, text))[1] for _ in range(repeats)]  # noqa: B023
        index = outlines.compile(kind, text)
        cache = {(kind, text): index}  # the runtime's cache was a dict lookup too
        row["outlines-core"] = {"cold_ms": 1e3 * statistics.median(cold),
                                "cached_us": 1e6 * timed(lambda: cache[(kind, text)])[1]}  # noqa: B023
        times, ok = outlines.walk(index, tokens)
        row["outlines-core"].update(step=micros(times), accepted=ok)
        rows.append(row)
        print(f"{kind:11} {name:32} xgrammar {row['xgrammar']['cold_ms']:8.2f} ms "
              f"outlines-core {row['outlines-core']['cold_ms']:8.1f} ms", flush=True)
    return {"setup_s": setup, "vocab_size": vocab_size, "eos_ids": eos_ids, "cases": rows,
            "versions": {"xgrammar": version("xgrammar"),
                         "outlines-core": version("outlines-core")}}


def apply_masks_cost(batch: int, vocab: int, repeats: int = 20) -> dict[str, float]:
    """The worker's masking alone: `batch` rows, each allowing a random tenth of the vocabulary."""
    import torch

    from radixserve.messages import SeqSampling
    from radixserve.worker.sampler import apply_masks

    rng = np.random.default_rng(0)
    params = [SeqSampling(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, seed=0, step=0,
                          allowed_mask=np.packbits(rng.random(vocab) < 0.1,
                                                   bitorder="little").tobytes())
              for _ in range(batch)]
    logits = torch.randn(batch, vocab)
    apply_masks(logits.clone(), params)
    times = [timed(lambda: apply_masks(logits.clone(), params))[1] for _ in range(repeats)]
    clone = [timed(logits.clone)[1] for _ in range(repeats)]
    return {"ms": 1e3 * (statistics.median(times) - statistics.median(clone)), "batch": batch}


def engine_part(model_dir: Path, batch: int, new_tokens: int, repeats: int) -> dict[str, Any]:
    from radixserve import Engine

    modes = {"unconstrained": {}, "json_schema": {"json_schema": json.dumps(ENGINE_SCHEMA)},
             "regex": {"regex": ENGINE_REGEX}}
    with Engine(str(model_dir), max_total_tokens=batch * 256) as engine:
        tok = engine.tokenizer
        prompts = [tok.encode(tok.apply_chat_template(
            [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], tokenize=False,
            add_generation_prompt=True)) for i in range(batch)]
        vocab = engine.info.vocab_size

        def run(mode: str) -> dict[str, Any]:
            engine.flush_cache()  # every run prefills the same way
            before, cpu = engine.stats(), time.process_time()
            outs, wall = timed(lambda: engine.generate(input_ids=prompts, sampling_params=[
                {"max_new_tokens": new_tokens, "temperature": 1.0, "seed": i,
                 "ignore_eos": True, **modes[mode]} for i in range(batch)]))
            after, cpu = engine.stats(), time.process_time() - cpu
            assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs), mode
            steps = after["steps"] - before["steps"]
            tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
            return {"wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall,
                    "cpu_s": cpu, "tokens_per_cpu_s": tokens / cpu,
                    "steps": steps, "scheduler_ms_per_step": 1e3 * (
                        after["scheduler_seconds_total"] - before["scheduler_seconds_total"])
                    / steps, "forward_ms_per_step": 1e3 * (
                        after["forward_seconds_total"] - before["forward_seconds_total"]) / steps,
                    "sample_output": outs[0]["text"][:80]}

        for mode in modes:  # warm-up: compile, first forwards
            engine.generate(input_ids=prompts[0], sampling_params={
                "max_new_tokens": 2, "ignore_eos": True, **modes[mode]})
        runs: dict[str, list[dict]] = {mode: [] for mode in modes}
        for _ in range(repeats):  # interleaved, so a slow spell of the machine hits all
            for mode in modes:
                runs[mode].append(run(mode))
                r = runs[mode][-1]
                print(f"{mode:14} {r['tokens_per_s']:7.1f} tok/s "
                      f"{r['tokens_per_cpu_s']:7.1f} tok/CPU-s  scheduler "
                      f"{r['scheduler_ms_per_step']:.2f} ms/step  forward "
                      f"{r['forward_ms_per_step']:.1f} ms/step", flush=True)
    best = {mode: max(rs, key=lambda r: r["tokens_per_s"]) for mode, rs in runs.items()}
    per_cpu = {mode: statistics.median(r["tokens_per_cpu_s"] for r in rs)
               for mode, rs in runs.items()}
    base = best["unconstrained"]
    for mode, r in best.items():
        r["ratio"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["median_tokens_per_cpu_s"] = per_cpu[mode]
        r["cpu_ratio"] = per_cpu[mode] / per_cpu["unconstrained"]
        r["extra_scheduler_ms_per_step"] = (r["scheduler_ms_per_step"]
                                            - base["scheduler_ms_per_step"])
    return {"batch": batch, "new_tokens": new_tokens, "repeats": repeats, "runs": runs,
            "loadavg_at_end": os.getloadavg()[0],
            "best": best, "apply_masks": apply_masks_cost(batch, vocab)}


def markdown(r: dict[str, Any]) -> str:
    m, lib = r["machine"], r["library"]
    lines = [f"# Grammar backends: outlines-core vs xgrammar ({m['commit']})", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, torch threads {m['torch_threads']}, "
             f"load at start {m['loadavg_at_start'][0]:.2f}; xgrammar "
             f"{lib['versions']['xgrammar']}, outlines-core {lib['versions']['outlines-core']}; "
             f"vocabulary {lib['vocab_size']:,} tokens (SmolLM2).", "",
             f"Vocabulary set-up: xgrammar {1e3 * lib['setup_s']['xgrammar']:.0f} ms, "
             f"outlines-core {1e3 * lib['setup_s']['outlines-core']:.0f} ms.", "",
             "## Compile and per-step mask cost", "",
             "Cold: median of fresh compiles; cached: the runtime's cache lookup. Step: the mask "
             "for each next token along the example output (outlines-core: first visit of "
             "each DFA state, which the runtime then cached).", "",
             "| kind | case | tokens | xgrammar cold ms | outlines cold ms | speed-up | "
             "xgrammar cached us | xgrammar step mean / max us | outlines step mean / max us "
             "| accepted (x / o) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in lib["cases"]:
        x, o = c["xgrammar"], c["outlines-core"]
        lines.append(
            f"| {c['kind']} | {c['name']} | {c['example_tokens']} | {x['cold_ms']:.2f} | "
            f"{o['cold_ms']:.1f} | {o['cold_ms'] / x['cold_ms']:.0f}x | {x['cached_us']:.1f} | "
            f"{x['step']['mean_us']:.1f} / {x['step']['max_us']:.0f} | "
            f"{o['step']['mean_us']:.1f} / {o['step']['max_us']:.0f} | "
            f"{x['accepted']} / {o['accepted']} |")
    rejected = [f"{name} rejects the valid {c['kind']} example of `{c['name']}`"
                for c in lib["cases"] for name in ("xgrammar", "outlines-core")
                if not c[name]["accepted"]]
    if rejected:
        lines += [""] + [f"- {line} (its tokens as the tokenizer spells them)."
                         for line in rejected]
    e = r.get("engine")
    if e:
        lines += ["", f"## Engine: {e['batch']} sampled requests x {e['new_tokens']} tokens "
                  f"(best of {e['repeats']}, interleaved)", "",
                  "Wall: the best run; CPU: the median run's output tokens per CPU-second of "
                  "this process (less sensitive to other processes on the machine).", "",
                  "| mode | output tok/s | vs unconstrained | tok per CPU-s | vs unconstrained "
                  "| scheduler ms/step | forward ms/step | steps |",
                  "|---|---|---|---|---|---|---|---|"]
        for mode, b in e["best"].items():
            lines.append(f"| {mode} | {b['tokens_per_s']:.1f} | {b['ratio']:.3f} | "
                         f"{b['median_tokens_per_cpu_s']:.1f} | {b['cpu_ratio']:.3f} | "
                         f"{b['scheduler_ms_per_step']:.2f} | {b['forward_ms_per_step']:.1f} | "
                         f"{b['steps']} |")
        j, base = e["best"]["json_schema"], e["best"]["unconstrained"]
        cost = j["extra_scheduler_ms_per_step"] + e["apply_masks"]["ms"]
        step = base["scheduler_ms_per_step"] + base["forward_ms_per_step"]
        lines += ["", f"- Grammar work in the scheduler at batch {e['batch']}: "
                  f"+{j['extra_scheduler_ms_per_step']:.2f} ms per step (json_schema) for "
                  f"{e['batch']} matchers; the worker's `apply_masks` alone: "
                  f"{e['apply_masks']['ms']:.2f} ms per step (in the forward column). "
                  f"Together {cost:.2f} ms, {cost / step:.1%} of an unconstrained step: the "
                  "overhead the tokens/s ratio measures through this machine's noise "
                  f"(load at the end {e['loadavg_at_end']:.2f} on {r['machine']['cores']} "
                  "cores)."]
    return "\n".join(lines + [""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--engine-repeats", type=int, default=5)
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    model_dir = resolve_model(DEFAULT_MODEL)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    report: dict[str, Any] = {"machine": machine_info(), "args": settings,
                              "library": library_part(model_dir, args.repeats)}
    if not args.skip_engine:
        report["engine"] = engine_part(model_dir, args.batch, args.new_tokens,
                                       args.engine_repeats)
    save_table(report, args.out / "grammar", markdown(report))


if __name__ == "__main__":
    main()
