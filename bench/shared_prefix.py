"""Shared-prefix workload: radixserve with the cache on and off against transformers.

G groups x P questions; each group has its own system prompt of S tokens, each question Q
tokens, O new tokens each (greedy, EOS ignored so every runner does the same work). All
runners get the same prompts in one run, so the ratios compare like with like.

    python bench/shared_prefix.py --preset quick     # ~3 minutes on 2 cores
    python bench/shared_prefix.py --preset full      # 8 x 8, 1,000-token system prompts
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import time
from pathlib import Path

import torch

PRESETS = {
    "quick": dict(groups=4, per_group=4, system_tokens=400, question_tokens=30, output_tokens=16),
    "full": dict(groups=8, per_group=8, system_tokens=1000, question_tokens=30, output_tokens=32),
}
WORDS = ("river market engine quiet silver window garden theory simple yellow travel "
         "history signal forest number paper mountain kitchen planet orange library music "
         "careful winter bridge science animal ocean village summer energy letter morning "
         "pattern circle friend machine island school voice people sudden").split()


def make_prompts(tokenizer, groups: int, per_group: int, system_tokens: int,
                 question_tokens: int, seed: int = 0) -> list[list[int]]:
    """Deterministic token prompts: group g's system prompt, then a distinct question."""
    rng = random.Random(seed)

    def text(n_tokens: int) -> list[int]:
        words = " ".join(rng.choice(WORDS) for _ in range(n_tokens * 2))
        return tokenizer.encode(words)[:n_tokens]

    prompts = []
    for _ in range(groups):
        system = text(system_tokens)
        prompts.extend(system + text(question_tokens) for _ in range(per_group))
    order = list(range(len(prompts)))
    rng.shuffle(order)  # arrivals interleave the groups, as real traffic would
    return [prompts[i] for i in order]


def run_engine(engine, prompts: list[list[int]], output_tokens: int) -> dict:
    params = {"max_new_tokens": output_tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    results = engine.generate(input_ids=prompts, sampling_params=params)
    wall = time.perf_counter() - start
    metas = [r["meta_info"] for r in results]
    prompt_tokens = sum(m["prompt_tokens"] for m in metas)
    return summarize(wall, [m["ttft"] for m in metas], len(prompts) * output_tokens,
                     prompt_tokens, cached=sum(m["cached_tokens"] for m in metas))


def run_transformers(model, tokenizer, prompts: list[list[int]], output_tokens: int,
                     batch_size: int) -> dict:
    """`generate` on left-padded batches; TTFT is when each batch's first token is chosen."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class FirstToken(LogitsProcessor):
        def __init__(self) -> None:
            self.at: float | None = None

        def __call__(self, input_ids, scores):
            self.at = self.at or time.perf_counter()
            return scores

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ttfts = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        hook = FirstToken()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_tokens,
                           min_new_tokens=output_tokens, do_sample=False, pad_token_id=pad,
                           logits_processor=LogitsProcessorList([hook]))
        ttfts.extend([hook.at - start] * len(batch))
    wall = time.perf_counter() - start
    return summarize(wall, ttfts, len(prompts) * output_tokens, sum(map(len, prompts)), cached=0)


def summarize(wall: float, ttfts: list[float], output_tokens: int, prompt_tokens: int,
              cached: int) -> dict:
    ttfts = sorted(ttfts)
    return {
        "wall_s": wall, "output_tokens_per_s": output_tokens / wall,
        "total_tokens_per_s": (output_tokens + prompt_tokens) / wall,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "cache_hit_rate": cached / prompt_tokens,
    }


def ttft_cached_vs_cold(engine, tokenizer, system_tokens: int) -> dict:
    """TTFT of one request whose system prompt is cached, against the same request cold."""
    a, b = make_prompts(tokenizer, 1, 2, system_tokens, 30, seed=99)
    params = {"max_new_tokens": 1, "temperature": 0}
    engine.flush_cache()
    cold = engine.generate(input_ids=a, sampling_params=params)["meta_info"]["ttft"]
    warm = engine.generate(input_ids=b, sampling_params=params)["meta_info"]
    return {"cold_s": cold, "cached_s": warm["ttft"], "cached_tokens": warm["cached_tokens"],
            "ratio": warm["ttft"] / cold}


def machine_info() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "commit": commit}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=PRESETS, default="quick")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    shape = PRESETS[args.preset]

    from transformers import AutoModelForCausalLM

    from radixserve import Engine
    from radixserve.model.loader import load_tokenizer, resolve_model

    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    prompts = make_prompts(tokenizer, shape["groups"], shape["per_group"],
                           shape["system_tokens"], shape["question_tokens"])
    out_tokens = shape["output_tokens"]
    runs: dict[str, dict] = {}
    for name, cache in (("radixserve cache on", True), ("radixserve cache off", False)):
        with Engine(str(model_dir), enable_prefix_cache=cache) as engine:
            runs[name] = run_engine(engine, prompts, out_tokens)
            if cache:
                ttft = ttft_cached_vs_cold(engine, tokenizer, shape["system_tokens"])
        print(name, json.dumps(runs[name]), flush=True)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                              local_files_only=True).eval()
    runs["transformers generate"] = run_transformers(hf, tokenizer, prompts, out_tokens,
                                                     args.hf_batch_size)
    print("transformers", json.dumps(runs["transformers generate"]), flush=True)

    base = runs["transformers generate"]["output_tokens_per_s"]
    off = runs["radixserve cache off"]["output_tokens_per_s"]
    on = runs["radixserve cache on"]["output_tokens_per_s"]
    report = {"preset": args.preset, "shape": shape, "machine": machine_info(), "runs": runs,
              "ttft_cached_vs_cold": ttft,
              "ratios": {"cache_on_vs_transformers": on / base, "cache_on_vs_cache_off": on / off}}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"shared_prefix_{args.preset}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
    stem.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


def markdown(report: dict) -> str:
    s = report["shape"]
    lines = [f"# Shared-prefix workload ({report['preset']})", "",
             f"{s['groups']} groups x {s['per_group']} questions, system prompt "
             f"{s['system_tokens']} tokens, question {s['question_tokens']}, output "
             f"{s['output_tokens']} tokens, greedy. Machine: {report['machine']}", "",
             "| runner | output tok/s | total tok/s | TTFT p50 s | TTFT p99 s | cache hit | wall s |",
             "|---|---|---|---|---|---|---|"]
    for name, r in report["runs"].items():
        lines.append(f"| {name} | {r['output_tokens_per_s']:.2f} | {r['total_tokens_per_s']:.1f} "
                     f"| {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | "
                     f"{r['cache_hit_rate']:.0%} | {r['wall_s']:.1f} |")
    t, q = report["ttft_cached_vs_cold"], report["ratios"]
    lines += ["", f"- cache on vs transformers generate: **{q['cache_on_vs_transformers']:.2f}x** "
              "output tokens/s (target >= 3x)",
              f"- cache on vs cache off: **{q['cache_on_vs_cache_off']:.2f}x** (target >= 3x)",
              f"- TTFT with the {s['system_tokens']}-token prefix cached: {t['cached_s']:.3f} s vs "
              f"{t['cold_s']:.3f} s cold = **{t['ratio']:.3f}x** (target <= 0.15x)", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
