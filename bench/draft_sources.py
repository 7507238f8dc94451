"""The model-free draft sources alone (speculative/lookup.py, speculative/suffix_index.py):
what they cost and how often their drafts would be accepted.

    python bench/draft_sources.py            # ~1 minute on one core

Costs: `SuffixIndex.add` / `remove` of a 2,048-token sequence (random tokens, and text made
of repeated phrases) into an index already holding the corpus below; `propose` of 8 tokens
from a 64-token tail (one that the index knows, one it does not); memory per indexed token
(tracemalloc, the corpus and random tokens); `ContextLookup.extend` per token and
`propose`; and `RadixCache.insert` + `evict` of 2,048-token sequences with the index fed
against without (the ratio is the hook's overhead on the scheduler's cache work).

Acceptance: the corpus is this repository's Python files and docs, tokenized with the
default model's tokenizer; 15 files are held out, the index holds the rest (what earlier
requests left in the tree). Each held-out file is decoded as if by greedy speculative
decoding whose target always writes the file: each step drafts up to 8 tokens, the longest
matching prefix is accepted, plus the target's own token. Reported: tokens per step (the
speed-up's ceiling when verification is free, as at batch 1), precision (accepted / drafted:
what a wrong draft wastes when it is not, at large batches) and drafted tokens per step.
"""

from __future__ import annotations

import argparse
import glob
import random
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import git_commit, machine_info, measure_limits
from bench.report import save_table
from radixserve.cache import BlockAllocator, RadixCache
from radixserve.config import DEFAULT_MODEL
from radixserve.model.loader import load_tokenizer, resolve_model
from radixserve.speculative.lookup import ContextLookup
from radixserve.speculative.suffix_index import SuffixIndex

ROOT = Path(__file__).resolve().parent.parent
HELD_OUT = 15
DRAFT = 8


def corpus(model: str) -> tuple[list[list[int]], list[list[int]]]:
    """(held-out sequences, indexed sequences): the repository's files, tokenized."""
    files = sorted(glob.glob(str(ROOT / "radixserve/**/*.py"), recursive=True)
                   + glob.glob(str(ROOT / "docs/*.md")))
    random.Random(0).shuffle(files)
    tok = load_tokenizer(resolve_model(model))
    seqs = [tok.encode(Path(f).read_text()) for f in files]
    return seqs[:HELD_OUT], seqs[HELD_OUT:]


def timed_us(fn: Callable[[], object], repeats: int) -> float:
    """Best microseconds per call of ``repeats`` (this machine's cores are shared: the best
    is the cost without the others' interference)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return min(times)


def repetitive(rng: random.Random, n: int) -> list[int]:
    phrases = [[rng.randrange(32000) for _ in range(16)] for _ in range(40)]
    out: list[int] = []
    while len(out) < n:
        out += rng.choice(phrases) + [rng.randrange(32000)]
    return out[:n]


def bytes_per_token(make: Callable[[], object], fill: Callable[[object], int]) -> float:
    tracemalloc.start()
    thing = make()
    tokens = fill(thing)
    used = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return used / tokens


def costs(held: list[list[int]], indexed: list[list[int]]) -> dict[str, Any]:
    rng = random.Random(1)
    index = SuffixIndex()
    for seq in indexed:
        index.add(None, [], seq)
    out: dict[str, Any] = {"index_holds_tokens": index.tokens}
    for kind, seq in (("random", [rng.randrange(32000) for _ in range(2048)]),
                      ("repetitive", repetitive(rng, 2048))):
        adds, removes = [], []
        for _ in range(20):  # each add undone, so the index stays as it was
            start = time.perf_counter()
            index.add(None, [], seq)
            mid = time.perf_counter()
            index.remove(None, [], seq)
            adds.append(mid - start)
            removes.append(time.perf_counter() - mid)
        out[f"add_2k_{kind}_ms"] = min(adds) * 1e3  # best: see timed_us
        out[f"remove_2k_{kind}_ms"] = min(removes) * 1e3
    known = held[0][:64]  # the index holds similar code: a typical tail
    unknown = [rng.randrange(32000) for _ in range(64)]
    out["propose_8_known_tail_us"] = timed_us(lambda: index.propose(None, known, DRAFT), 200)
    out["propose_8_unknown_tail_us"] = timed_us(lambda: index.propose(None, unknown, DRAFT), 200)
    out["proposed_from_known_tail"] = len(index.propose(None, known, DRAFT))
    out["propose_tree_8_known_tail_us"] = timed_us(
        lambda: index.propose_tree(None, known, DRAFT), 200)
    for kind, seqs in (("corpus", indexed),
                       ("random", [[rng.randrange(32000) for _ in range(2048)]
                                   for _ in range(50)])):
        def fill(ix: SuffixIndex, seqs: list[list[int]] = seqs) -> int:
            for s in seqs:
                ix.add(None, [], s)
            return ix.tokens
        out[f"bytes_per_token_{kind}"] = bytes_per_token(SuffixIndex, fill)
        out[f"bytes_per_token_{kind}_ctx8"] = bytes_per_token(lambda: SuffixIndex(8), fill)
    seq = held[0] * (1 + 4096 // len(held[0]))
    out["lookup_extend_4k_us_per_token"] = timed_us(
        lambda: ContextLookup().extend(seq[:4096]), 5) / 4096
    look = ContextLookup()
    look.extend(seq[:4096])
    out["lookup_propose_8_us"] = timed_us(lambda: look.propose(DRAFT), 200)
    noise = [rng.randrange(32000) for _ in range(4096)]
    for kind, toks in (("file", seq[:4096]), ("random", noise)):
        out[f"lookup_bytes_per_token_{kind}"] = bytes_per_token(
            ContextLookup, lambda c, toks=toks: (c.extend(toks), len(c.tokens))[1])
    out.update(hook_overhead(rng))
    return out


def hook_overhead(rng: random.Random) -> dict[str, float]:
    """insert + evict of 2,048-token sequences, page size 16, with and without the index."""
    seqs = [[rng.randrange(32000) for _ in range(2048)] for _ in range(20)]

    def replay(index: SuffixIndex | None) -> float:
        alloc = BlockAllocator(4 * 128)
        cache = RadixCache(alloc, 16, token_index=index)
        start = time.perf_counter()
        for s in seqs:
            if alloc.num_free < 128:
                cache.evict(128)
            blocks = alloc.alloc(128)
            cache.insert(s, blocks)
            alloc.free(blocks)
        return (time.perf_counter() - start) * 1e3 / len(seqs)

    plain = min(replay(None) for _ in range(5))
    fed = min(replay(SuffixIndex()) for _ in range(5))
    return {"tree_insert_evict_2k_ms": plain, "tree_insert_evict_2k_indexed_ms": fed}


def simulate(tokens: list[int], propose: Callable[[int], list[int]],
             feed: Callable[[list[int]], object]) -> tuple[int, int, int]:
    """(steps, accepted draft tokens, drafted tokens) decoding ``tokens`` after a 64-token
    prompt."""
    i, steps, accepted, drafted = 64, 0, 0, 0
    feed(tokens[:i])
    while i < len(tokens):
        draft = propose(DRAFT)
        a = 0
        while a < len(draft) and i + a < len(tokens) and draft[a] == tokens[i + a]:
            a += 1
        n = min(a + 1, len(tokens) - i)
        feed(tokens[i:i + n])
        i += n
        steps, accepted, drafted = steps + 1, accepted + a, drafted + len(draft)
    return steps, accepted, drafted


def acceptance(held: list[list[int]], indexed: list[list[int]]) -> list[dict[str, Any]]:
    rows = []

    def row(source: str, runs: list[tuple[int, int, int]]) -> None:
        steps, acc, drafted = (sum(r[i] for r in runs) for i in range(3))
        rows.append({"source": source, "tokens_per_step": (steps + acc) / steps,
                     "precision": acc / max(drafted, 1), "drafted_per_step": drafted / steps})

    for lo in (1, 2, 3):
        runs = []
        for seq in held:
            look = ContextLookup(4, lo)
            runs.append(simulate(seq, look.propose, look.extend))
        row(f"lookup, n-grams 4 down to {lo}", runs)
    for k, lo, p in ((8, 2, 0.1), (6, 2, 0.1), (4, 2, 0.1), (4, 1, 0.1), (4, 2, 0.3)):
        index = SuffixIndex(k, lo, p)
        for seq in indexed:
            index.add(None, [], seq)
        runs = []
        for seq in held:
            tail: list[int] = []
            runs.append(simulate(seq, lambda m, ix=index, t=tail: ix.propose(None, t, m),
                                 tail.extend))
        row(f"index, context {k}, min match {lo}, min prob {p}", runs)
    return rows


def markdown(r: dict[str, Any]) -> str:
    c = r["costs"]
    lines = [
        "# Draft sources: costs and acceptance", "",
        f"Commit {r['commit']}; {r['machine']['cpu']}, one thread (load average "
        f"{r['machine']['loadavg_at_start'][0]:.1f} at the start); "
        f"corpus {r['corpus_tokens']:,} tokens ({r['held_out_tokens']:,} held out).", "",
        "| cost | figure |", "|---|---|",
        f"| SuffixIndex.add, 2,048 tokens, random / repetitive | {c['add_2k_random_ms']:.1f} / "
        f"{c['add_2k_repetitive_ms']:.1f} ms |",
        f"| SuffixIndex.remove, the same | {c['remove_2k_random_ms']:.1f} / "
        f"{c['remove_2k_repetitive_ms']:.1f} ms |",
        f"| SuffixIndex.propose, 8 tokens, known / unknown tail | "
        f"{c['propose_8_known_tail_us']:.0f} / {c['propose_8_unknown_tail_us']:.0f} us |",
        f"| SuffixIndex.propose_tree, 8 nodes, known tail | "
        f"{c['propose_tree_8_known_tail_us']:.0f} us |",
        f"| SuffixIndex memory per token, corpus / random (context 4) | "
        f"{c['bytes_per_token_corpus']:.0f} / {c['bytes_per_token_random']:.0f} B |",
        f"| the same, context 8 | {c['bytes_per_token_corpus_ctx8']:.0f} / "
        f"{c['bytes_per_token_random_ctx8']:.0f} B |",
        f"| ContextLookup.extend per token / propose 8 | "
        f"{c['lookup_extend_4k_us_per_token']:.1f} / {c['lookup_propose_8_us']:.1f} us |",
        f"| ContextLookup memory per token, a file repeated / random | "
        f"{c['lookup_bytes_per_token_file']:.0f} / {c['lookup_bytes_per_token_random']:.0f} B |",
        f"| RadixCache insert + evict of 2,048 tokens, without / with the index | "
        f"{c['tree_insert_evict_2k_ms']:.2f} / {c['tree_insert_evict_2k_indexed_ms']:.2f} ms |",
        "", "Times: the best of several runs (the machine's cores are shared).", "",
        f"Acceptance, drafts of up to {DRAFT}:", "",
        "| source | tokens/step | precision | drafted/step |", "|---|---|---|---|"]
    for a in r["acceptance"]:
        lines.append(f"| {a['source']} | {a['tokens_per_step']:.3f} | {a['precision']:.3f} | "
                     f"{a['drafted_per_step']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    held, indexed = corpus(args.model)
    result = {"commit": git_commit(), "machine": machine_info(),
              "limits": measure_limits(quick=True),
              "corpus_tokens": sum(map(len, held + indexed)),
              "held_out_tokens": sum(map(len, held)),
              "costs": costs(held, indexed), "acceptance": acceptance(held, indexed)}
    save_table(result, args.out / "draft_sources", markdown(result))
    return result


if __name__ == "__main__":
    main()
