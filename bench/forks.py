"""Copy-on-write forks: `n` parallel samples and beam search, against their baselines.

Samples: `n` = 8 seeded samples of one 1,000-token prompt as one request (they fork from
the first sample once it has computed the prompt, sharing its blocks; the partly filled last
block is copied on first write) against the path before copy-on-write: eight independent
requests with seeds `seed + i` (what `n` = 8 was expanded into), with the prefix cache on
(the others wait for the first and recompute the last page from the tree) and off (each
prefills the whole prompt). Wall time, prefill tokens, blocks copied and the peak of blocks
in use; outputs must be equal in every mode.

Beams: `Engine.beam_search(beam_width=4, max_new_tokens=64)` against transformers'
`generate(num_beams=4, do_sample=False)` on the same prompts and weights (fp32, CPU), with
the beams compared.

    python bench/forks.py [--prompt-tokens 1000] [--n 8] [--new-tokens 32]

Writes `bench/results/forks.{json,md}` with the commit and the machine's measured limits.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import machine_info, measure_limits
from bench.report import save_table
from radixserve import Engine
from radixserve.config import DEFAULT_MODEL
from radixserve.model.loader import resolve_model

TEXT = ("The committee met on a grey morning to weigh the harbour plans: the new breakwater, "
        "the dredging of the inner basin, and the fate of the old customs house. ")
BEAM_PROMPTS = ["The three laws of thermodynamics state that", "def quicksort(items):",
                "My grandmother's recipe for bread begins with"]


def prompt_ids(tokenizer: Any, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(TEXT)
    return ids[:n]


def run_samples(engine: Engine, ids: list[int], n: int, new_tokens: int, mode: str) -> dict:
    params = {"max_new_tokens": new_tokens, "temperature": 0.8, "top_p": 0.95, "seed": 5,
              "ignore_eos": True}
    engine.flush_cache()
    sched = engine.scheduler
    sched.cache.allocator.peak_used = 0
    before = engine.stats()
    start = time.perf_counter()
    if mode == "fork":
        outs = engine.generate(input_ids=ids, sampling_params={**params, "n": n})
    else:
        outs = engine.generate(input_ids=[ids] * n, sampling_params=[
            {**params, "seed": params["seed"] + i} for i in range(n)])
    seconds = time.perf_counter() - start
    after = engine.stats()
    return {"mode": mode, "seconds": seconds,
            "prefill_tokens": after["prefill_tokens"] - before["prefill_tokens"],
            "copied_blocks": after["copied_blocks"] - before["copied_blocks"],
            "peak_used_blocks": after["peak_used_blocks"],
            "outputs": [o["output_ids"] for o in outs]}


def samples(model_dir: Path, args: argparse.Namespace) -> list[dict]:
    rows = []
    for cache in (True, False):
        engine = Engine(str(model_dir), enable_prefix_cache=cache, page_size=16)
        ids = prompt_ids(engine.tokenizer, args.prompt_tokens)
        run_samples(engine, ids[:64], 2, 2, "fork")  # warm-up
        for mode in ("fork", "independent"):
            row = run_samples(engine, ids, args.n, args.new_tokens, mode)
            row["prefix_cache"] = cache
            rows.append(row)
            print(f"cache={cache} {mode}: {row['seconds']:.2f} s, prefill "
                  f"{row['prefill_tokens']}, peak {row['peak_used_blocks']} blocks", flush=True)
        engine.shutdown()
    reference = rows[0]["outputs"]
    for row in rows:
        row["outputs_equal"] = row.pop("outputs") == reference
    return rows


def beams(model_dir: Path, args: argparse.Namespace) -> list[dict]:
    from transformers import AutoModelForCausalLM

    engine = Engine(str(model_dir))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                              local_files_only=True).eval()
    engine.beam_search("Hello", beam_width=2, max_new_tokens=2)  # warm-up
    rows = []
    for prompt in BEAM_PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        start = time.perf_counter()
        ours = engine.beam_search(input_ids=ids, beam_width=args.beam_width,
                                  max_new_tokens=args.beam_tokens)
        ours_s = time.perf_counter() - start
        start = time.perf_counter()
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), num_beams=args.beam_width, do_sample=False,
                              num_return_sequences=args.beam_width,
                              max_new_tokens=args.beam_tokens, output_scores=True,
                              return_dict_in_generate=True)
        hf_s = time.perf_counter() - start
        ref_ids = [s[len(ids):].tolist() for s in ref.sequences]
        same = all(r[:len(b["output_ids"])] == b["output_ids"] for r, b in zip(ref_ids, ours))
        gap = max(abs(b["meta_info"]["beam_score"] - float(s))
                  for b, s in zip(ours, ref.sequences_scores))
        rows.append({"prompt": prompt, "radixserve_s": ours_s, "transformers_s": hf_s,
                     "speedup": hf_s / ours_s, "beams_equal": same, "max_score_gap": gap,
                     "tokens": max(len(b["output_ids"]) for b in ours)})
        print(f"{prompt!r}: {ours_s:.2f} s vs transformers {hf_s:.2f} s, equal={same}", flush=True)
    engine.shutdown()
    return rows


def markdown(report: dict) -> str:
    a = report["args"]
    lines = [f"# Copy-on-write forks ({report['machine']['commit']})", "",
             f"Machine: {report['machine']['cpu']}; limits {report['limits']}", "",
             f"## n = {a['n']} samples of a {a['prompt_tokens']}-token prompt, "
             f"{a['new_tokens']} new tokens each", "",
             "| prefix cache | mode | time (s) | prefill tokens | blocks copied | peak blocks "
             "| outputs equal |", "|---|---|---|---|---|---|---|"]
    for r in report["samples"]:
        lines.append(f"| {'on' if r['prefix_cache'] else 'off'} | {r['mode']} | "
                     f"{r['seconds']:.2f} | {r['prefill_tokens']} | {r['copied_blocks']} | "
                     f"{r['peak_used_blocks']} | {r['outputs_equal']} |")
    lines += ["", f"## Beam search, width {a['beam_width']}, {a['beam_tokens']} tokens", "",
              "| prompt | radixserve (s) | transformers (s) | speed-up | beams equal | "
              "max score gap |", "|---|---|---|---|---|---|"]
    for r in report["beams"]:
        lines.append(f"| {r['prompt']} | {r['radixserve_s']:.2f} | {r['transformers_s']:.2f} | "
                     f"{r['speedup']:.2f}x | {r['beams_equal']} | {r['max_score_gap']:.1e} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--beam-width", type=int, default=4)
    p.add_argument("--beam-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args()
    model_dir = resolve_model(args.model)
    report: dict[str, Any] = {"args": vars(args) | {"out": str(args.out)},
                              "machine": machine_info(), "limits": measure_limits()}
    report["samples"] = samples(model_dir, args)
    report["beams"] = beams(model_dir, args)
    save_table(report, args.out / "forks", markdown(report))


if __name__ == "__main__":
    main()
