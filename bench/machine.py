"""The machine's limits, measured in the same run as the benchmark, and what it is.

- fp32 matmul rate: a square `torch.matmul` at the run's thread count, best of a few;
- memory bandwidth: a large tensor copy (read + write bytes per second, STREAM's
  convention) and a large reduction (read bytes per second; decode reads its weights, so
  this is the decode floor's bandwidth);
- peak RSS: a sampling thread over a block of work (`RssMonitor`), and the process's
  lifetime peak from `getrusage`;
- the environment: CPU, cores, threads, load average, library versions, git commit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import threading
import time
import timeit
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch


def preset_args(doc: str, presets: dict[str, Any], default_model: str,
                extra: Callable[[argparse.ArgumentParser], object] | None = None,
                threads: bool = False) -> argparse.Namespace:
    """The options every preset-sized benchmark has (`--preset`, `--model`, `--out`), what
    `extra` adds and, with `threads`, `--threads` (torch's thread count, set here); parsed."""
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(presets), default="quick")
    p.add_argument("--model", default=default_model)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    if threads:
        p.add_argument("--threads", type=int, default=None)
    if extra is not None:
        extra(p)
    args = p.parse_args()
    if threads and args.threads:
        torch.set_num_threads(args.threads)
    return args


def names_of(known: Iterable[str]) -> Callable[[str], list[str]]:
    """An argparse `type`: a comma-separated list whose every name is one of `known`."""
    choices = list(known)

    def parse(text: str) -> list[str]:
        names = [n for n in text.split(",") if n]
        if unknown := [n for n in names if n not in choices]:
            raise argparse.ArgumentTypeError(f"unknown {unknown[0]!r}; known: {', '.join(choices)}")
        return names

    return parse


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: page faults, thread pool start
    return min(timeit.repeat(fn, repeat=repeats, number=1))


def matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    return 2 * n ** 3 / best_seconds(lambda: torch.matmul(a, b, out=out), repeats) / 1e9


def copy_gbs(mbytes: int = 256, repeats: int = 5) -> float:
    src = torch.randn(mbytes * 2 ** 20 // 4)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / best_seconds(lambda: dst.copy_(src), repeats) / 1e9


def read_gbs(mbytes: int = 256, repeats: int = 5) -> float:
    src = torch.randn(mbytes * 2 ** 20 // 4)
    return src.nbytes / best_seconds(lambda: src.sum(), repeats) / 1e9


def measure_limits(quick: bool = False) -> dict[str, float]:
    """Matmul GFLOP/s and memory GB/s at torch's current thread count."""
    n, mb = (1024, 64) if quick else (2048, 256)
    return {"matmul_gflops": matmul_gflops(n), "copy_gbs": copy_gbs(mb),
            "read_gbs": read_gbs(mb), "threads": torch.get_num_threads()}


def rss_mb() -> float:
    """Current resident set size of this process in MiB."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
    except (OSError, ValueError, IndexError):
        return lifetime_peak_rss_mb()


def lifetime_peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2 ** 20 if sys.platform == "darwin" else peak / 2 ** 10  # bytes vs KiB


@dataclass
class ModelRun:
    """What a benchmark of one model has before it runs anything."""

    started: float
    """`time.perf_counter()` at the start, for the report's elapsed time."""
    machine: dict[str, Any]
    limits: dict[str, float]
    """The machine's limits, measured now (`measure_limits`)."""
    model_dir: Path
    encode: Callable[[str], list[int]]
    """The model's tokenizer, text to ids without special tokens."""


def start_model_run(model: str, threads: int | None, quick_limits: bool = False) -> ModelRun:
    """Set torch's threads (`threads`, if given), measure the machine's limits (printed)
    and load `model`'s tokenizer."""
    from radixserve.model.loader import load_tokenizer, resolve_model

    if threads:
        torch.set_num_threads(threads)
    started, machine = time.perf_counter(), machine_info()
    limits = measure_limits(quick=quick_limits)
    print(f"limits: {json.dumps(limits)}", flush=True)
    model_dir = resolve_model(model)
    tokenizer = load_tokenizer(model_dir)
    return ModelRun(started, machine, limits, model_dir,
                    lambda text: tokenizer.encode(text, add_special_tokens=False))


class RssMonitor:
    """Peak RSS (MiB) of this process while the `with` block runs, sampled every `period`."""

    def __init__(self, period: float = 0.02) -> None:
        self.period = period
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, rss_mb())
            if self._stop.wait(self.period):
                return

    def __enter__(self) -> RssMonitor:
        self.peak = rss_mb()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_mb())


def git_commit(repo: Path | None = None) -> str:
    """Short commit of the repository holding this file, `+dirty` if it has changes."""
    cwd = repo or Path(__file__).resolve().parent
    try:
        def run(*args: str) -> str:
            return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                                  check=True).stdout.strip()

        commit = run("rev-parse", "--short", "HEAD")
        return commit + ("+dirty" if run("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_model() -> str:
    """The CPU's name, family and model, and its widest vector ISA: a cloud VM's name alone
    ("AMD EPYC") covers Zen 2 to Zen 5, with and without AVX-512."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    info = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in first if ":" in line)}
    flags = info.get("flags", "").split()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return (f"{info.get('model name', platform.machine())} (family {info.get('cpu family')} "
            f"model {info.get('model')}, {isa})")


def machine_line(m: dict[str, Any], threads: int | None = None) -> str:
    """The sentence that opens every bench report, from `machine_info()`'s `m`: the
    commit, the CPU, its cores, the torch threads (where the run sets them) and the load
    average when the run started (a shared machine's figures move with it)."""
    threads_part = "" if threads is None else f", torch threads {threads}"
    return (f"Commit `{m['commit']}`, {m['cpu']}, {m['cores']} cores{threads_part}, "
            f"load average at start {m['loadavg_at_start'][0]:.2f}")


def machine_info() -> dict[str, Any]:
    import transformers

    import radixserve

    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    except (ValueError, OSError):
        mem_gib = float("nan")
    return {
        "cpu": cpu_model(), "cores": os.cpu_count(), "memory_gib": round(mem_gib, 1),
        "torch_threads": torch.get_num_threads(), "loadavg_at_start": os.getloadavg(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "commit": git_commit(),
        # The editable install may point at another checkout than this bench/ directory.
        "radixserve_path": str(Path(radixserve.__file__).parent),
        "radixserve_commit": git_commit(Path(radixserve.__file__).parent),
    }
