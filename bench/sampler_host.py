"""The sampler's host cost per step on a CPU, before and after it moved onto the device
(issue 43, item 4): the sampler of `--baseline` (the last commit that sampled row by row
from Python lists, loaded from `git show`) against this checkout's.

    python bench/sampler_host.py --threads 1     # batch 8/64/256, vocabulary 49,152 (~1 min)
    python bench/sampler_host.py --batches 2,4 --vocab 512 --seconds 0.2 --out /tmp/x

Two workloads, the same logits and parameters for both samplers:

- `greedy`: every row greedy (the engine's tests, and most benchmarks);
- `mixed`: rows cycling through greedy, top-k, top-p, min-p, the three penalties over a
  prompt and an output, and the three filters together, each with its own seed (`mixed`).

Each step is `Sampler()(logits, params)` and the copy of its ids to the host (`.tolist()`),
timed as the median over at least `--repeats` steps and `--seconds` after a warm-up, the
two samplers taking turns, and its host syncs counted
(`HostSyncs`): on a CPU a sync costs nothing, so the count is what a GPU would pay for (a
stall of the launch queue each), and the milliseconds are the host's own work.

Writes `bench/results/sampler_host.{json,md}`.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import machine_info, machine_line
from bench.report import save_table
from radixserve.messages import SeqSampling

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "3cf4361"
"""The last commit whose sampler read its parameters row by row on the host."""
SCALAR_READS = ("aten._local_scalar_dense", "aten.item")
"""What `.item()`, `bool()`, `int()` and `float()` of a tensor dispatch to: one sync each."""
COPIES = (torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy)
"""Whole-tensor reads by the host, which the dispatcher does not show for a CPU tensor."""


class _Reads(TorchDispatchMode):
    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if str(func.overloadpacket) in SCALAR_READS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


class _Copies(TorchFunctionMode):
    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func in COPIES:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


class HostSyncs:
    """Counts the host's reads of tensor values inside a `with` block, on any device: the
    scalar reads the dispatcher sees and the whole-tensor copies torch's function layer
    sees. On a GPU each is a sync; on a CPU they are the same calls, so a CPU test counts
    what a GPU step would wait for. `seen` names them in order."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self._modes = (_Copies(self.seen), _Reads(self.seen))

    def __enter__(self) -> HostSyncs:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    @property
    def count(self) -> int:
        return len(self.seen)


def mixed_params(batch: int, vocab: int) -> list[SeqSampling]:
    """`batch` rows cycling through greedy, top-k, top-p, min-p, the penalties (a 256-token
    prompt, 64 outputs) and all three filters, each with its own seed and step."""
    gen = torch.Generator().manual_seed(batch)
    kinds: list[dict[str, Any]] = [
        dict(temperature=0.0), dict(top_k=40, temperature=0.8), dict(top_p=0.9),
        dict(min_p=0.05, temperature=1.2),
        dict(frequency_penalty=0.4, presence_penalty=0.2, repetition_penalty=1.1,
             temperature=0.7),
        dict(top_k=50, top_p=0.95, min_p=0.02, temperature=0.9)]
    rows = []
    for i in range(batch):
        kind = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                **kinds[i % len(kinds)]}
        p = SeqSampling(seed=1000 + i, step=i % 7, **kind)
        if "repetition_penalty" in kind:
            p.prompt_ids = torch.randint(vocab, (256,), generator=gen).tolist()
            p.output_ids = torch.randint(vocab, (64,), generator=gen).tolist()
        rows.append(p)
    return rows


def greedy_params(batch: int, vocab: int) -> list[SeqSampling]:
    return [SeqSampling(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, seed=i, step=0)
            for i in range(batch)]


WORKLOADS: dict[str, Callable[[int, int], list[SeqSampling]]] = {
    "greedy": greedy_params, "mixed": mixed_params}


def baseline_sampler(commit: str) -> Any:
    """`Sampler()` of `radixserve/worker/sampler.py` as it was at `commit`."""
    source = subprocess.run(["git", "show", f"{commit}:radixserve/worker/sampler.py"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout
    spec = importlib.util.spec_from_loader(f"sampler_{commit}", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, f"{commit}:radixserve/worker/sampler.py", "exec"), module.__dict__)
    return module.Sampler()


def step(sampler: Any, logits: torch.Tensor, params: list[SeqSampling]) -> list[int]:
    """One step's sampling as the worker runs it: the ids, copied to the host."""
    return sampler(logits, params).tolist()


def measure(samplers: dict[str, Any], logits: torch.Tensor, params: list[SeqSampling],
            repeats: int, seconds: float) -> dict[str, dict[str, Any]]:
    """Each sampler's median milliseconds per step, over at least `repeats` steps and
    `seconds`, the samplers taking turns (a shared machine's load falls on both alike);
    and each one's host syncs, counted on one more step."""
    times: dict[str, list[float]] = {name: [] for name in samplers}
    for sampler in samplers.values():
        step(sampler, logits, params)  # warm-up
    spent = 0.0
    while spent < seconds or len(times[next(iter(times))]) < repeats:
        for name, sampler in samplers.items():
            start = time.perf_counter()
            step(sampler, logits, params)
            times[name].append(time.perf_counter() - start)
            spent += times[name][-1]
    out = {}
    for name, sampler in samplers.items():
        with HostSyncs() as syncs:
            step(sampler, logits, params)
        out[name] = {"ms": statistics.median(times[name]) * 1e3, "steps": len(times[name]),
                     "syncs": syncs.count}
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# The sampler's host cost per step, `{report['baseline']}` against this "
             "checkout", "",
             machine_line(report["machine"], report["machine"]["torch_threads"]) +
             f". float32 logits `[batch, {report['vocab']}]` on the CPU; the median step "
             f"over at least {report['repeats']} steps and {report['seconds']:g} s after a "
             "warm-up, the two samplers taking turns; a step is the sampler and the copy "
             "of its ids to the host. `syncs`: the host's reads of tensor values in a step "
             "(`.item()`/`bool()`/`float()`, `.tolist()`/`.cpu()`/`.numpy()`), each a stall "
             "on a GPU. `mixed`: rows cycling through greedy, top-k, top-p, min-p, the "
             "penalties (256 prompt + 64 output tokens) and all three filters, each seeded.",
             "", "| workload | batch | old ms | new ms | old / new | old syncs | new syncs |",
             "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['workload']} | {r['batch']} | {r['old']['ms']:.2f} | "
                     f"{r['new']['ms']:.2f} | {r['old']['ms'] / r['new']['ms']:.2f}x | "
                     f"{r['old']['syncs']} | {r['new']['syncs']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from radixserve.worker.sampler import Sampler

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="8,64,256")
    p.add_argument("--vocab", type=int, default=49152, help="default: smollm2-135m's")
    p.add_argument("--repeats", type=int, default=7, help="steps at least, per sampler")
    p.add_argument("--seconds", type=float, default=2.0, help="time at least, both together")
    p.add_argument("--baseline", default=BASELINE)
    p.add_argument("--threads", type=int, default=None, help="torch's (default: its own)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    old, new = baseline_sampler(args.baseline), Sampler()
    report: dict[str, Any] = {"machine": machine_info(), "baseline": args.baseline,
                              "vocab": args.vocab, "repeats": args.repeats,
                              "seconds": args.seconds, "rows": []}
    for workload, make in WORKLOADS.items():
        for batch in map(int, args.batches.split(",")):
            logits = torch.randn(batch, args.vocab, generator=torch.Generator().manual_seed(
                batch)) * 3
            params = make(batch, args.vocab)
            row = {"workload": workload, "batch": batch,
                   **measure({"old": old, "new": new}, logits, params, args.repeats,
                             args.seconds)}
            report["rows"].append(row)
            print(f"{workload} batch {batch}: old {row['old']}, new {row['new']}", flush=True)
    save_table(report, args.out / "sampler_host", markdown(report))


if __name__ == "__main__":
    main()
