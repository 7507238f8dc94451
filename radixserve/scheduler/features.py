"""The optional features' part in the scheduler's step, as hooks the pipeline holds only while
a feature is on.

A feature (overlap scheduling, speculative decoding, tenant shares, pins, the disk tier,
output constraints, the virtual layout's mappings) is a `StepFeature` that
overrides the hooks it needs. `StepHooks` keeps, for each hook, the bound methods of the
features on that override it, so a step calls nothing of a feature that is off: with every
feature off each list is empty. A feature turns on when the scheduler is made (from the
config and the worker's info) or the first time a request or call needs it (`Scheduler.
turn_on`); it stays on. Each feature's class is imported by the code that turns it on, not by
the step's path.

The hooks, in the order a step meets them:

- `start_step()`: before the batch is planned (pins expire, compiled constraints join).
- `preempt(waiting, running)`: a running request to retract so a waiting one gets a place.
- `draft(decodes, budget, running)`: extra tokens for the step's decodes (speculation);
  returns how many of `budget` they took.
- `wants_step()`: whether the worker has work with no sequence to step (the disk tier's
  transfers): a step goes to it all the same.
- `launched(batch)`: the step goes to the worker.
- `folded(batch, result)`: the step's result is in (None: the worker failed it), before its
  sequences are advanced; returns the indices of sequences whose result is to be dropped.
- `releasing(req)`: a sequence's KV is about to be given back.
- `finished(req, reason)`: a request ended; True when its answer goes to nobody.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar, cast

if TYPE_CHECKING:
    from radixserve.messages import ForwardResult
    from radixserve.scheduler.batch import ScheduledBatch, ScheduledSeq
    from radixserve.scheduler.request import Req


class OverloadedError(RuntimeError):
    """No room for the request now (the queue, a tenant's share of it, the grammar
    compiler): it was not queued."""


HOOKS = ("start_step", "preempt", "draft", "wants_step", "launched", "folded", "releasing",
         "finished")


class StepFeature:
    """A feature's hooks: each a no-op here, overridden by the features that use it."""

    def start_step(self) -> None:
        pass

    def preempt(self, waiting: list[Req], running: list[Req]) -> Req | None:
        return None

    def draft(self, decodes: list[ScheduledSeq], budget: int, running: list[Req]) -> int:
        return 0

    def wants_step(self) -> bool:
        return False

    def launched(self, batch: ScheduledBatch) -> None:
        pass

    def folded(self, batch: ScheduledBatch, result: ForwardResult | None) -> set[int]:
        return set()

    def releasing(self, req: Req) -> None:
        pass

    def finished(self, req: Req, reason: dict[str, Any]) -> bool:
        return False


F = TypeVar("F", bound=StepFeature)


class StepHooks:
    """The features on, and for each hook the methods to call (only the overridden ones)."""

    def __init__(self) -> None:
        self.on: dict[type, StepFeature] = {}
        self.start_step: list = []
        self.preempt: list = []
        self.draft: list = []
        self.wants_step: list = []
        self.launched: list = []
        self.folded: list = []
        self.releasing: list = []
        self.finished: list = []

    def add(self, feature: F) -> F:
        """Turn `feature` on (once per class: the one on already is returned)."""
        if type(feature) in self.on:
            return cast(F, self.on[type(feature)])
        self.on[type(feature)] = feature
        for hook in HOOKS:
            if getattr(type(feature), hook) is not getattr(StepFeature, hook):
                getattr(self, hook).append(getattr(feature, hook))
        return feature

    def dropped(self, batch: ScheduledBatch, result: ForwardResult | None) -> set[int]:
        """Every `folded` hook run; the sequences whose results any of them drops (the
        caller asks only while some feature has the hook)."""
        dropped: set[int] = set()
        for hook in self.folded:
            dropped |= hook(batch, result)
        return dropped
