"""The runner interface: a runner takes a workload's requests and returns per-request timings.

Adding a runner (e.g. the radixserve server through the RPC client) is one small class:

    class RpcRunner(Runner):
        name = "radixserve-rpc"
        def open(self): self.client = Client(self.address)
        def generate(self, prompts, requests):   # one wave; submit all, honour a rate
            ...                                   # or a concurrency limit here
            return [Completion(output_ids, cached, submitted, first_token, finished), ...]

`Runner.run` drives the waves (a conversation's next turn needs the previous turn's
output), builds each prompt from the runner's own earlier outputs, times the run, samples
peak RSS and turns completions into `RequestRecord`s. Times in a `Completion` are
`time.perf_counter()` values; records hold seconds since the run started.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from bench.machine import RssMonitor
from bench.metrics import RequestRecord
from bench.workloads import Request, Workload

GREEDY = {"temperature": 0.0, "ignore_eos": True}
"""Every runner decodes greedily and ignores EOS, so all do the same number of tokens."""


@dataclass
class Completion:
    output_ids: list[int]
    cached_tokens: int
    """Prompt tokens whose KV was reused rather than computed."""
    submitted: float
    first_token: float
    finished: float


@dataclass
class RunResult:
    runner: str
    workload: str
    records: list[RequestRecord]
    outputs: dict[str, list[int]] = field(repr=False)
    peak_rss_mb: float
    cpu_s: float
    """CPU seconds this process spent during the run (all threads). With one torch thread
    it stays close to the work done when other processes steal the cores; wall time
    does not."""
    info: dict[str, Any] = field(default_factory=dict)


class Runner(ABC):
    name = "runner"

    def settings(self) -> dict[str, Any]:
        """What a reader needs to reproduce this runner (batch size, engine options...)."""
        return {}

    def open(self) -> None:
        """Load the model and warm up (not timed)."""

    def close(self) -> None:
        """Free the model."""

    def begin(self, workload: Workload) -> None:
        """Called before a run (e.g. to reset caches or learn which requests have children)."""

    def info(self) -> dict[str, Any]:
        """Runner-side facts after a run (engine stats...)."""
        return {}

    @abstractmethod
    def generate(self, prompts: list[list[int]], requests: list[Request]) -> list[Completion]:
        """Run one wave: every request is submitted now; return completions in order."""

    def run(self, workload: Workload) -> RunResult:
        self.begin(workload)
        prompts: dict[str, list[int]] = {}
        outputs: dict[str, list[int]] = {}
        records: list[RequestRecord] = []
        cpu_start = time.process_time()
        with RssMonitor() as rss:
            start = time.perf_counter()
            for wave in workload.waves():
                wave_prompts = [workload.prompt(r, prompts, outputs) for r in wave]
                done = self.generate(wave_prompts, wave)
                if len(done) != len(wave):
                    raise RuntimeError(f"{self.name}: {len(done)} completions for {len(wave)}")
                for req, prompt, c in zip(wave, wave_prompts, done):
                    if len(c.output_ids) != req.output_tokens:
                        raise RuntimeError(f"{self.name}: {req.rid} produced "
                                           f"{len(c.output_ids)} of {req.output_tokens} tokens")
                    prompts[req.rid], outputs[req.rid] = prompt, list(c.output_ids)
                    records.append(RequestRecord(
                        req.rid, req.group, req.turn, len(prompt), c.cached_tokens,
                        len(c.output_ids), c.submitted - start, c.first_token - start,
                        c.finished - start))
        cpu = time.process_time() - cpu_start
        return RunResult(self.name, workload.name, records, outputs, rss.peak, cpu, self.info())

    def __enter__(self) -> Runner:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
