"""What the scheduler's phases share: the queues, the requests by rid, the counters and the
admission ratio. Each phase is handed this one object; only the phases change it."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.config import EngineConfig
from radixserve.scheduler.request import Req, SeqGroup

COUNTERS = ("steps", "prefill_tokens", "decode_tokens", "retractions", "finished", "aborted",
            "cascade_steps", "cascade_shared_runs", "forked_samples", "graph_steps",
            "eager_steps")


@dataclass
class SchedulerState:
    config: EngineConfig
    waiting: list[Req] = field(default_factory=list)
    """Sequences waiting to (re)join the batch, first in line first after the policy's order."""
    running: list[Req] = field(default_factory=list)
    """Sequences holding KV and computing, oldest first (the newest is retracted first)."""
    groups: dict[str, SeqGroup] = field(default_factory=dict)
    """Each unfinished request's outputs, by rid."""
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    new_token_ratio: float = 0.0
    """The share of the running requests' remaining `max_new_tokens` that admission keeps
    room for: reset by a retraction, decayed by each step (scheduler/admission.py)."""
    in_flight: int = 0
    """Steps launched and not folded or failed yet (more than 0 at planning time only with
    overlap scheduling)."""

    def __post_init__(self) -> None:
        self.new_token_ratio = self.config.init_new_token_ratio
