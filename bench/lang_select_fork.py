"""DSL workloads with the radix cache on and off: few-shot select, and fork.

- select: Q questions x 4 choices after one few-shot prefix of ~P tokens (run_batch of a
  `select` program: one prefix commit + one batch of 4 scoring requests per question);
- fork: F programs, each a ~P-token system prompt forked 4 ways, 8 greedy tokens per
  branch (EOS ignored, so both runs do the same work).

Both run on an in-process Engine with `enable_prefix_cache` on, then on a fresh one with
it off (where the DSL skips its prefix commits, which would be wasted work), in one run.
Reported: requests, prompt tokens, prefill tokens served from the cache (saved), wall
time, and whether the two runs decided the same (select) / generated the same (fork).

    python bench/lang_select_fork.py --preset quick     # ~3 minutes on 2 cores
    python bench/lang_select_fork.py --preset full      # 64 x 4 select, 16 forks (long)
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import radixserve.lang as sgl  # noqa: E402
from bench.machine import machine_info, machine_line  # noqa: E402
from bench.report import save_table  # noqa: E402

PRESETS = {
    "quick": dict(questions=6, prefix_tokens=500, forks=2, branches=4, branch_tokens=8),
    "full": dict(questions=64, prefix_tokens=500, forks=16, branches=4, branch_tokens=8),
}
CHOICES = [" science", " history", " sport", " art"]
WORDS = ("river market engine quiet silver window garden theory simple yellow travel "
         "history signal forest number paper mountain kitchen planet orange library music "
         "careful winter bridge science animal ocean village summer energy letter morning "
         "pattern circle friend machine island school voice people sudden").split()


def few_shot_prefix(tokenizer, n_tokens: int, rng: random.Random) -> str:
    text = "Label each question with its topic: science, history, sport or art.\n\n"
    while len(tokenizer.encode(text)) < n_tokens:
        words = " ".join(rng.choice(WORDS) for _ in range(12))
        text += f"Question: {words}?\nTopic:{rng.choice(CHOICES)}\n\n"
    return text


def questions(n: int, rng: random.Random) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(10)) + "?" for _ in range(n)]


@sgl.function
def classify(s, prefix, question):
    s += prefix + "Question: " + question + "\nTopic:"
    s += sgl.select("topic", choices=CHOICES)


@sgl.function
def forked(s, system, question, branches, branch_tokens):
    s += sgl.system(system)
    s += sgl.user(question)
    forks = s.fork(branches)
    forks += lambda i: sgl.assistant(f"Idea {i + 1}:" + sgl.gen(
        "idea", max_tokens=branch_tokens, temperature=0, ignore_eos=True))
    forks.join()


def run_workloads(cache: bool, cfg: dict, seed: int) -> dict:
    rng = random.Random(seed)
    backend = sgl.EngineBackend(enable_prefix_cache=cache)
    tok = backend.tokenizer
    prefix = few_shot_prefix(tok, cfg["prefix_tokens"], rng)
    qs = questions(cfg["questions"], rng)
    out: dict = {"prefix_tokens": len(tok.encode(prefix))}

    def measure(name: str, fn) -> None:
        backend.reset_stats()
        start = time.perf_counter()
        states = fn()
        wall = time.perf_counter() - start
        errors = [s.error() for s in states if s.error() is not None]
        if errors:
            raise RuntimeError(f"{name}: {errors[0]!r}")
        st = backend.stats()
        out[name] = {"requests": st["requests"], "prompt_tokens": st["prompt_tokens"],
                     "prefill_tokens_saved": st["cached_tokens"],
                     "prefill_tokens_computed": st["prompt_tokens"] - st["cached_tokens"],
                     "cache_hit_rate": st["cache_hit_rate"], "wall_s": wall}
        out[name + "_outputs"] = ([s["topic"] for s in states] if name == "select"
                                  else [s["idea"] for s in states])

    measure("select", lambda: classify.run_batch(
        [{"prefix": prefix, "question": q} for q in qs], backend=backend))
    system = few_shot_prefix(tok, cfg["prefix_tokens"], random.Random(seed + 1))
    measure("fork", lambda: forked.run_batch(
        [{"system": system, "question": q, "branches": cfg["branches"],
          "branch_tokens": cfg["branch_tokens"]} for q in qs[:cfg["forks"]]], backend=backend))
    backend.shutdown()
    return out


def markdown(report: dict) -> str:
    cfg = report["config"]
    lines = [f"# DSL workloads, radix cache on vs off ({report['preset']})", "",
             f"select: {cfg['questions']} questions x {len(CHOICES)} choices after a "
             f"{report['on']['prefix_tokens']}-token few-shot prefix; fork: {cfg['forks']} "
             f"programs x {cfg['branches']} branches after a ~{cfg['prefix_tokens']}-token "
             f"system prompt, {cfg['branch_tokens']} tokens each. In-process Engine, "
             f"{machine_line(report['machine'])}.", "",
             "| workload | cache | requests | prompt tokens | prefill saved | prefill computed "
             "| hit rate | wall s |", "|---|---|---|---|---|---|---|---|"]
    for name in ("select", "fork"):
        for mode in ("on", "off"):
            r = report[mode][name]
            lines.append(f"| {name} | {mode} | {r['requests']} | {r['prompt_tokens']} | "
                         f"{r['prefill_tokens_saved']} | {r['prefill_tokens_computed']} | "
                         f"{r['cache_hit_rate']:.1%} | {r['wall_s']:.1f} |")
    lines.append("")
    for name in ("select", "fork"):
        s = report["speedup"][name]
        same = report["same_outputs"][name]
        lines.append(f"- {name}: cache on is **{s:.1f}x** faster (target >= 3x); "
                     f"same outputs with the cache off: {same}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    cfg = PRESETS[args.preset]
    on = run_workloads(True, cfg, args.seed)
    off = run_workloads(False, cfg, args.seed)
    report = {
        "preset": args.preset, "config": cfg, "on": on, "off": off,
        "machine": machine_info(),
        "speedup": {n: off[n]["wall_s"] / on[n]["wall_s"] for n in ("select", "fork")},
        "same_outputs": {n: on[n + "_outputs"] == off[n + "_outputs"]
                         for n in ("select", "fork")},
    }
    save_table(report, args.out / f"lang_{args.preset}", markdown(report))


if __name__ == "__main__":
    main()
