"""The GPU run: the CUDA tests, then the Triton attention path and the engine timed (sized
for < 8 minutes on one H200).

    python bench/gpu/run.py --out $OUT                 # a GPU machine
    python bench/gpu/run.py --sections step --tiny --out /tmp/g   # the CPU smoke test's

Sections (each guarded: a failure is recorded and the rest still run):
- tests: `pytest tests/gpu tests/worker/test_virtual_kv_cuda.py` (every kernel against its
  torch reference in bf16, quantization refused on CUDA, the virtual layout on the real
  driver), its verdict one row;
- bandwidth: a large device-to-device copy (read + write bytes / time);
- decode: paged decode, batch 64 x 4k context: achieved bandwidth (KV + q + out bytes /
  time) against the copy bandwidth (target >= 70%), plus a small sweep of launch knobs;
- step: the GPU step (bench/gpu/step.py): CUDA graphs and overlap each on and off against
  transformers' `generate`: output tok/s, ms per decode step at batch 1/8/32/64, the GPU's
  busy share, greedy agreement with graphs off (its own table under `--out`/e2e too);
- cascade: tree attention, a decode step of 64 sequences in 8 groups of 8 over a
  1,000-token prefix per group (64-token private suffixes) through the Triton backend,
  with the step's cascade plan and without (per-layer attention time, GB/s of KV read,
  speedup; agreement of the two outputs), plus a small sweep of the cascade launch knobs;
- extend: against torch SDPA (flash backend) on the same shapes laid out contiguously
  (target: Triton time <= 1.3x SDPA), plus a small sweep of tile configs;
- virtual: the virtual KV layout on CUDA VMM (`worker/virtual_kv_cuda.py`), in both page
  layouts (`block` at page size 91, whose bf16 blocks fill 2 MiB pages; `layer` at 5,461):
  the cost of mapping a block, the decode kernel over the views against the paged read of
  the same blocks at batch 8/32/64 x 2k context, the default model's greedy outputs
  virtual vs paged, the steps that waited for a mapping, the views unmapped after a flush;
- tp: `Engine(tp_size=2)` over 2 GPUs (NCCL) against `tp_size=1` in float32: greedy
  outputs and a batch-64 decode step of each (skipped, saying why, with fewer than 2 GPUs);
- e2e: the shared-prefix workload through `radixserve.Engine` with the default model
  (cache hit rate, throughput, greedy agreement of the triton and torch backends).
Prints one table and writes `gpu_check.{json,md}` under `--out`. Timings use CUDA events.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

if __package__ in (None, ""):  # bench.* and tests.factories (the tensor-parallel model)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.gpu.engine import section_e2e, section_gpu_step, section_tp, section_virtual  # noqa
from bench.gpu.kernels import (section_bandwidth, section_cascade, section_decode,  # noqa
                               section_extend)
from bench.gpu.timing import ROWS, T0, row  # noqa: E402
from bench.report import save_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TESTS = ["tests/gpu", "tests/worker/test_virtual_kv_cuda.py"]


def section_tests() -> None:
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", *TESTS], cwd=ROOT,
                          capture_output=True, text=True)
    summary = (done.stdout.strip().splitlines() or ["no output"])[-1]
    row("tests", f"pytest {' '.join(TESTS)}", summary, "passed", done.returncode == 0)
    if done.returncode:
        print(done.stdout[-4000:], done.stderr[-2000:])


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="skip sections that would start after this many seconds")
    parser.add_argument("--sections", default=None, help="comma-separated subset (default all)")
    parser.add_argument("--tiny", action="store_true",
                        help="the step section on a tiny random model (runs on a CPU too)")
    parser.add_argument("--random", action="store_true",
                        help="the step section on random weights of the default model's shape")
    args = parser.parse_args()
    results: dict[str, float] = {}
    sections: dict[str, Callable[[], None]] = {
        "tests": section_tests, "bandwidth": lambda: section_bandwidth(results),
        "decode": lambda: section_decode(results), "step": lambda: section_gpu_step(args),
        "cascade": lambda: section_cascade(results), "extend": section_extend,
        "virtual": section_virtual, "tp": section_tp, "e2e": lambda: section_e2e(args)}
    chosen = args.sections.split(",") if args.sections else list(sections)
    if not torch.cuda.is_available() and not (args.tiny and chosen == ["step"]):
        raise SystemExit("no CUDA device (only `--sections step --tiny` runs without one)")
    row("env", "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        torch=torch.__version__)
    for name in chosen:
        if time.perf_counter() - T0 > args.budget_s - (120 if name == "e2e" else 30):
            row(name, "skipped", "out of time budget", ok=False)
            continue
        try:
            sections[name]()
        except Exception as exc:  # noqa: BLE001 - one failure must not hide the rest
            traceback.print_exc()
            row(name, "FAILED", f"{type(exc).__name__}: {str(exc)[:300]}", ok=False)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    lines = ["# GPU run", "", "| section | check | value | target | ok |", "|---|---|---|---|---|"]
    for r in ROWS:
        value = f"{r['value']:.4g}" if isinstance(r["value"], float) else str(r["value"])
        ok = "" if r["ok"] is None else ("PASS" if r["ok"] else "FAIL")
        lines.append(f"| {r['section']} | {r['name']} | {value[:60]} | {r['target']} | {ok} |")
    total_s = time.perf_counter() - T0
    save_table({"rows": ROWS, "total_s": total_s}, Path(args.out) / "gpu_check",
               "\n".join(lines) + f"\n\nTotal {total_s:.0f} s.\n")


if __name__ == "__main__":
    main()
