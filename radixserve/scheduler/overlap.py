"""Overlap scheduling: the scheduler prepares step N+1 while the worker runs step N, and
folds step N's result in afterwards (as SGLang's overlap scheduler does).

The contract:

- **Launched is computed.** The worker runs steps in the order they are sent, so the KV a
  step writes is there for every step sent after it: a step's KV counts from the moment
  `Scheduler.schedule` returns it (its sequences' `kv_len` advance then, on or off).
- **Running ahead.** A request whose launched step samples a token may run its next step
  before that token is known: it counts in `Req.behind` until folded, and the step sends
  `PLACEHOLDER` for it (`ForwardBatch.placeholders`), which the worker fills in on the
  device from the token it kept (`ForwardBatch.keep_tokens`). Only a request whose next
  step does not depend on the token on the host runs ahead (`runs_ahead`); the others wait
  for the fold, one step.
- **Finishing is the folds' alone**, token by token, as without overlap: EOS, stop ids and
  strings, max_new_tokens. A request that turns out to have finished at step N may already
  be in step N+1; its result there is dropped (and its blocks were given back at the fold
  of N). A request retracted or aborted while its step runs drops that step's result too:
  it ends or resumes where its folded tokens leave it, and as sampling is a function of
  (seed, step) a retracted request samples the same token again when it resumes.
- **Only folded KV is cached.** A request released while it has a step in flight is
  first cut back to the KV that folded steps computed (`settle`): nothing a step in flight
  writes or copies reaches the tree, so a step that fails leaves nothing cached, as
  without overlap. A failed step also fails the one sent behind it, whose placeholders
  (and rows) came from it.
- **Off is free**: without overlap (`Scheduler.overlap` None: by default anywhere but
  CUDA, where the host's cores would run both sides) nothing here runs.

`RunAhead` is the scheduler's side of it; `Pipeline` is the engine loop's (which step is
in flight on the worker, and which result to fold next).
"""

from __future__ import annotations

import os

from collections.abc import Iterator
from typing import Protocol

from radixserve.config import EngineConfig
from radixserve.messages import ForwardBatch, ForwardResult, WorkerInfo
from radixserve.scheduler.batch import ScheduledBatch, ScheduledSeq
from radixserve.scheduler.features import StepFeature
from radixserve.scheduler.kv import KVManager
from radixserve.scheduler.request import Req

OVERLAP_DEVICES = frozenset(os.environ.get("RADIXSERVE_OVERLAP_DEVICES", "cuda").split(","))
"""The device types the scheduler overlaps by default: where the device computes on its own
while the host prepares the next step. (A test hook: tests add "cpu" to run it here, in the
Engine by patching this, through `serve` by `RADIXSERVE_OVERLAP_DEVICES=cuda,cpu`, which
the server's processes inherit.)"""


def runs_ahead(seq: ScheduledSeq, speculative: str) -> bool:
    """Whether the request of `seq`, a step that samples, may run its next step before the
    token is folded: not when that step depends on the token on the host (a constraint's
    mask, penalties over the outputs, a draft that continues it, a beam search's choice,
    the samples that fork from a prompt's first token), nor when the token is its last."""
    req, sp = seq.req, seq.req.sampling
    return (seq.sample and not seq.draft and req.grammar is None
            and req.group.search is None and not req.group.unforked
            and not sp.has_penalties and (sp.speculative or speculative) == "off"
            and req.remaining_new_tokens > 1)


class RunAhead(StepFeature):
    """The scheduler's record of its steps in flight: each request's steps launched and not
    folded, the KV it held before each, and which of them it runs ahead of. Its hooks:
    `launched`, `folded` (the results dropped) and `releasing` (`settle`)."""

    def __init__(self, kv: KVManager, page_size: int, speculative: str) -> None:
        """`speculative`: the server's mode (a request's own overrides it)."""
        self.kv, self.page_size, self.speculative = kv, page_size, speculative
        self.unfolded: dict[Req, list[tuple[ScheduledSeq, int, bool]]] = {}
        """Per request with a step in flight: each such step, oldest first, as (its
        sequence, the KV valid before it, whether the request runs ahead of its token).
        The KV valid before it is the step's start, or less where the step copies a block
        in (copy-on-write, a kept partial block), which holds nothing valid until it runs."""

    @classmethod
    def of(cls, config: EngineConfig, info: WorkerInfo, kv: KVManager,
           overlap: bool | None) -> RunAhead | None:
        """The record for a scheduler of `info`'s worker if it overlaps its steps (`overlap`
        None: by default, on `OVERLAP_DEVICES` unless `disable_overlap_schedule`), else None."""
        if overlap is None:
            overlap = (not config.disable_overlap_schedule
                       and info.device.split(":")[0] in OVERLAP_DEVICES)
        return cls(kv, info.page_size, config.speculative) if overlap else None

    def launched(self, batch: ScheduledBatch) -> None:
        """`batch` goes to the worker now (its `kv_len`s advanced): record it, and have the
        worker keep the tokens its requests run ahead of."""
        forward, page = batch.forward, self.page_size
        copied = {dst for _, dst in forward.block_copies}
        for i, seq in enumerate(batch.seqs):
            req, valid = seq.req, seq.start
            table, first = req.kv.block_table, seq.start // page
            if copied and first < len(table) and table[first] in copied:
                valid = first * page
            ahead = runs_ahead(seq, self.speculative)
            self.unfolded.setdefault(req, []).append((seq, valid, ahead))
            if ahead:
                req.behind += 1
                forward.keep_tokens.append(i)

    def folded(self, batch: ScheduledBatch, result: ForwardResult | None) -> set[int]:
        """`batch`, the oldest step in flight, is folded (or failed) now: the indices of its
        sequences whose results are dropped (see `settle`)."""
        dropped = set()
        for i, seq in enumerate(batch.seqs):
            req = seq.req
            steps = self.unfolded.get(req)
            if not steps or steps[0][0] is not seq:
                dropped.add(i)
                continue
            _, _, ahead = steps.pop(0)
            if not steps:
                del self.unfolded[req]
            req.behind -= ahead
        return dropped

    def releasing(self, req: Req) -> None:
        self.settle(req)

    def settle(self, req: Req) -> None:
        """`req`'s KV is about to be released (finished, aborted, retracted, failed): drop
        its steps in flight, and cut its KV back to what folded steps computed, so that
        what is cached of it is valid whatever those steps do."""
        steps = self.unfolded.pop(req, None)
        if steps is None:
            return
        req.behind = 0
        if req.kv.node is not None:
            self.kv.truncate(req.kv, min(req.kv.kv_len, steps[0][1]))


class StepRunner(Protocol):
    """The worker as the pipeline drives it: steps sent in order, results back in order."""

    def launch(self, batch: ForwardBatch) -> None: ...

    def collect(self) -> ForwardResult:
        """The result of the oldest step launched and not collected; raises if it failed."""
        ...


Outcome = ForwardResult | Exception
"""A step's result, or why the worker failed it."""


class Pipeline:
    """The engine loop's side: a step is launched before the result of the one before it is
    collected, so the worker always has the next step while the scheduler folds."""

    def __init__(self, worker: StepRunner) -> None:
        self.worker = worker
        self.in_flight: ScheduledBatch | None = None
        """The step launched last, whose result is not collected yet."""
        self.run_ahead = 0
        """Steps launched while the one before was in flight (the stats' `steps_run_ahead`)."""

    def advance(self, batch: ScheduledBatch | None) -> Iterator[tuple[ScheduledBatch, Outcome]]:
        """Launch `batch` (None: nothing new), then yield the steps to fold now, each with
        its outcome, oldest first: the step launched before `batch`, or `batch` itself
        when its launch failed. The worker's time is spent between the yields."""
        previous, self.in_flight = self.in_flight, None
        failed: Exception | None = None
        if batch is not None:
            try:
                self.worker.launch(batch.forward)
                self.in_flight = batch
                self.run_ahead += previous is not None
            except Exception as e:  # the steps before it were sent: they still fold
                failed = e
        if previous is not None:
            yield from self._collect(previous)
        if batch is not None and failed is not None:
            yield batch, failed

    def drain(self) -> Iterator[tuple[ScheduledBatch, Outcome]]:
        """Yield the step in flight, if any, with its outcome: none is in flight after."""
        return self.advance(None)

    def _collect(self, batch: ScheduledBatch) -> Iterator[tuple[ScheduledBatch, Outcome]]:
        try:
            result: Outcome = self.worker.collect()
        except Exception as e:
            result = e
        yield batch, result
        behind = self.in_flight
        if isinstance(result, Exception) and behind is not None:
            self.in_flight = None  # it ran on what the failed step left: it fails too
            try:
                self.worker.collect()
            except Exception:
                pass
            yield behind, result
