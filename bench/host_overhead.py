"""The host's share of a decode step, measured on a CPU: where a step's time goes outside the
model's own arithmetic, so it can be driven down without a GPU (issue 43, item 5).

    python bench/host_overhead.py --preset quick   # batch 8/64/256 x 1024 tokens (~2 min)
    python bench/host_overhead.py --preset full    # batch 8/64/256 x 4096 tokens
    python bench/host_overhead.py --preset tiny    # seconds (the smoke test's)

A random Llama of the preset's `shape` (tests/factories.py), float32 on this CPU, the
default attention backend. For each batch size, `batch` unrelated requests of `context`
prompt tokens (no shared prefix, so every sequence carries its whole block table) are
prefilled, then `steps` decode steps are driven by hand the way the scheduler process and
the worker process do it, each phase timed:

- `schedule`: `Scheduler.schedule` (policy, admission, KV blocks), of which `build` is
  `build_forward_batch` (the step message's lists);
- `encode` / `decode`: the step message (`ForwardBatch`) through msgpack as it crosses the
  socket (its `bytes`), and the same for the reply (`ForwardResult`, `reply_bytes`);
- `prepare`: `Worker._prepare` (the message's lists turned into the step's tensors);
- `forward`: the model (`DecoderModel.forward`, every layer and the LM head);
- `sample`: the sampler over the logits (`sample_logits`, as the step is launched, and
  `read_logits`, its answers read back);
- `worker`: all of `Worker.forward`, and `fold`: `Scheduler.process_result`.

Host share: the step's time outside `forward`, over the whole step. On a CPU the model's
forward is slow, so the share understates a GPU's; what matters here is each host phase's
milliseconds, which a GPU would not shorten. Medians over the decode steps.

Writes `bench/results/host_overhead_<preset>.{json,md}` (`--name` replaces the preset in
the file name: the issue's before/after runs).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import msgspec
import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import machine_info, machine_line, measure_limits, micro_args
from bench.report import save_table
from radixserve.config import EngineConfig
from radixserve.messages import ForwardResult, SamplingParams, TokenizedRequest, WorkerInput
from radixserve.model.loader import cache_root, resolve_model
from radixserve.scheduler import scheduler as scheduler_module
from radixserve.scheduler.scheduler import Scheduler
from radixserve.worker import worker as worker_module
from radixserve.worker.worker import Worker

TINY = "tiny"
"""`--model`'s default: a random Llama of the preset's `shape`."""
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(batches=[2, 4], context=40, steps=3,
                 shape=dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                            intermediate_size=128)),
    "quick": dict(batches=[8, 64, 256], context=1024, steps=12,
                  shape=dict(num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2,
                             intermediate_size=256)),
    "full": dict(batches=[8, 64, 256], context=4096, steps=12,
                 shape=dict(num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2,
                            intermediate_size=256)),
}
PAGE = 16
CHUNK = 8192
"""The prefill's tokens per step (`chunked_prefill_size`)."""
PHASES = ("schedule", "build", "encode", "decode", "prepare", "forward", "sample", "worker",
          "reply_encode", "reply_decode", "fold", "step")
"""Each decode step's timed phases (milliseconds); `step` is the whole of them."""


class Timer:
    """Stands in for a function (set where its caller looks it up) and adds its calls'
    time to `seconds`."""

    def __init__(self, call: Callable[..., Any]) -> None:
        self.call = call
        self.seconds = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.call(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start

    def take(self) -> float:
        """Milliseconds since the last `take`."""
        ms, self.seconds = self.seconds * 1e3, 0.0
        return ms


def model_dir(model: str, shape: dict[str, int]) -> Path:
    if model != TINY:
        return resolve_model(model)
    from tests.factories import tiny_model_dir

    return tiny_model_dir(cache_root() / "bench-models", **shape)


def new_tokens(batch: int, context: int, steps: int) -> int:
    """Enough output tokens for `steps` steps with the whole batch decoding: those whose
    prefill ends first decode during the others' (a step of `CHUNK` tokens each)."""
    return steps + 2 + -(-batch * context // CHUNK)


def make_requests(batch: int, context: int, steps: int, vocab: int) -> list[TokenizedRequest]:
    """`batch` greedy requests of `context` distinct prompt tokens (no shared prefix) that
    run `steps` decode steps and more, whatever they sample."""
    gen = torch.Generator().manual_seed(batch)
    sampling = SamplingParams(max_new_tokens=new_tokens(batch, context, steps),
                              temperature=0.0, ignore_eos=True)
    return [TokenizedRequest(rid=f"r{i}", sampling=sampling, input_ids=torch.randint(
        10, vocab, (context,), generator=gen).tolist()) for i in range(batch)]


class Harness:
    """One scheduler and one worker, driven step by step as the two processes drive them,
    with every phase of a step timed."""

    def __init__(self, directory: Path, max_batch: int, context: int, steps: int) -> None:
        tokens = max_batch * (context + new_tokens(max_batch, context, steps) + 2 * PAGE)
        self.config = EngineConfig.from_kwargs(
            model=str(directory), page_size=PAGE, max_running_requests=max_batch,
            max_total_tokens=tokens, chunked_prefill_size=CHUNK)
        self.worker = Worker(self.config, directory)
        self.scheduler = Scheduler(self.config, self.worker.info())
        self.encoder = msgspec.msgpack.Encoder()
        self.step_decoder = msgspec.msgpack.Decoder(WorkerInput)
        self.reply_decoder = msgspec.msgpack.Decoder(ForwardResult)
        self.timers = {"build": Timer(scheduler_module.build_forward_batch),
                       "prepare": Timer(self.worker._prepare),
                       "forward": Timer(self.worker.model.forward),
                       "sample": Timer(worker_module.read_logits)}
        self.sample_rows = Timer(worker_module.sample_logits)
        """The sampler's half at launch, counted in `sample`."""
        # Where the callers look them up: the modules' globals, the instances' attributes.
        scheduler_module.build_forward_batch = self.timers["build"]  # type: ignore[assignment]
        worker_module.read_logits = self.timers["sample"]  # type: ignore[assignment]
        worker_module.sample_logits = self.sample_rows  # type: ignore[assignment]
        self.worker._prepare = self.timers["prepare"]  # type: ignore[method-assign]
        self.worker.model.forward = self.timers["forward"]  # type: ignore[method-assign]

    def close(self) -> None:
        scheduler_module.build_forward_batch = self.timers["build"].call  # type: ignore
        worker_module.read_logits = self.timers["sample"].call  # type: ignore
        worker_module.sample_logits = self.sample_rows.call  # type: ignore
        self.worker.close()

    def step(self) -> dict[str, float] | None:
        """One step through every phase: its milliseconds by phase, its message's bytes and
        batch shape; None when nothing ran."""
        t: dict[str, float] = {}
        mark = start = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal mark
            now = time.perf_counter()
            t[name] = (now - mark) * 1e3
            mark = now

        batch, _ = self.scheduler.schedule()
        lap("schedule")
        if batch is None:
            return None
        data = self.encoder.encode(batch.forward)
        lap("encode")
        forward = self.step_decoder.decode(data)
        lap("decode")
        result = self.worker.forward(forward)
        lap("worker")
        reply = self.encoder.encode(result)
        lap("reply_encode")
        result = self.reply_decoder.decode(reply)
        lap("reply_decode")
        self.scheduler.process_result(batch, result)
        lap("fold")
        t["step"] = (mark - start) * 1e3
        for name, timer in self.timers.items():
            t[name] = timer.take()
        t["sample"] += self.sample_rows.take()
        t.update(bytes=len(data), reply_bytes=len(reply), seqs=len(forward.q_lens),
                 tokens=len(forward.input_ids))
        return t

    def measure(self, requests: list[TokenizedRequest], steps: int) -> dict[str, Any]:
        """Prefill `requests` (untimed), then `steps` decode steps of all of them at once."""
        for request in requests:
            self.scheduler.add_request(request)
        while True:  # the prefills, until every request is decoding
            t = self.step()
            assert t is not None, "the requests ended before decoding"
            if t["tokens"] == len(requests) == t["seqs"]:
                break
        rows = [self.step() for _ in range(steps)]
        while self.step() is not None:  # let them finish, for the next batch
            pass
        decodes = [r for r in rows if r is not None and r["tokens"] == r["seqs"] == len(requests)]
        assert len(decodes) == steps, "a decode step ran other work or fewer sequences"
        out: dict[str, Any] = {name: statistics.median(r[name] for r in decodes)
                               for name in (*PHASES, "bytes", "reply_bytes")}
        out["host_ms"] = statistics.median(r["step"] - r["forward"] for r in decodes)
        out["host_share"] = statistics.median(1 - r["forward"] / r["step"] for r in decodes)
        return out


def markdown(report: dict[str, Any]) -> str:
    m, lim, shape = report["machine"], report["limits"], report["shape"]
    lines = [f"# The host's share of a decode step: `{report['name']}`", "",
             machine_line(m, lim["threads"]) + "; measured limits "
             f"(same run): fp32 matmul {lim['matmul_gflops']:.1f} GFLOP/s, memory read "
             f"{lim['read_gbs']:.1f} GB/s. Model `{report['model']}` ({shape}), float32, page "
             f"size {PAGE}, attention backend `{report['attention_backend']}`. Each batch: "
             f"that many requests of {report['context']} prompt tokens (no shared prefix), "
             f"medians of {report['steps']} decode steps, milliseconds per step.", "",
             "Scheduler side: `schedule` (of which `build`: the step message's lists), "
             "`encode` / `decode`: the step message through msgpack (`KB`), `fold`: "
             "`process_result`. Worker side: `prepare` (the message into tensors), `forward` "
             "(the model), `sample`, `worker` (all of `Worker.forward`); reply: the "
             "`ForwardResult` through msgpack. Host: the step minus the model's forward.", "",
             "| batch | step | schedule | build | encode | decode | KB | prepare | forward | "
             "sample | worker | reply enc+dec | fold | host ms | host share |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(
            f"| {r['batch']} | {r['step']:.2f} | {r['schedule']:.2f} | {r['build']:.2f} | "
            f"{r['encode']:.3f} | {r['decode']:.3f} | {r['bytes'] / 1e3:.1f} | "
            f"{r['prepare']:.2f} | {r['forward']:.2f} | {r['sample']:.2f} | "
            f"{r['worker']:.2f} | {r['reply_encode'] + r['reply_decode']:.3f} | "
            f"{r['fold']:.2f} | **{r['host_ms']:.2f}** | {r['host_share']:.0%} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    args = micro_args(__doc__ or "", PRESETS, TINY, lambda p: p.add_argument(
        "--name", default=None, help="the results' file name after host_overhead_ "
                                     "(default: the preset)"))
    preset = PRESETS[args.preset]
    name = args.name or args.preset
    limits = measure_limits(quick=args.preset == "tiny")
    directory = model_dir(args.model, preset["shape"])
    harness = Harness(directory, max(preset["batches"]), preset["context"], preset["steps"])
    report: dict[str, Any] = {
        "name": name, "preset": args.preset, "machine": machine_info(), "limits": limits,
        "model": args.model, "shape": preset["shape"], "context": preset["context"],
        "steps": preset["steps"],
        "attention_backend": type(harness.worker.backend).__name__, "rows": []}
    try:
        for batch in preset["batches"]:
            requests = make_requests(batch, preset["context"], preset["steps"],
                                     harness.worker.info().vocab_size)
            row = {"batch": batch, **harness.measure(requests, preset["steps"])}
            report["rows"].append(row)
            print(f"batch {batch}: step {row['step']:.2f} ms, host {row['host_ms']:.2f} ms "
                  f"({row['host_share']:.0%}), message {row['bytes'] / 1e3:.1f} KB", flush=True)
    finally:
        harness.close()
    save_table(report, args.out / f"host_overhead_{name}", markdown(report))


if __name__ == "__main__":
    main()
