"""One sequence's speculation state (kept on its `Req`): its mode, its own context's
lookup, and how many tokens it may draft for its recent acceptance."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from radixserve.speculative.lookup import ContextLookup

PROBE_EVERY = 16
"""Steps without a draft (for poor acceptance) before one token is tried again."""
PROBE_ACCEPTANCE = 0.5
"""The acceptance a probe is worth trying for: where the step's break-even is above it
(a compute-bound batch), an idle sequence does not probe."""
ACCEPTANCE_WEIGHT = 0.5
"""Weight of the newest step in the running acceptance rate."""


@dataclass(eq=False)
class SeqDrafts:
    """One sequence's speculation: its mode, its own context's lookup, its acceptance."""

    mode: str
    acceptance: float
    """Running share of drafted tokens accepted (at first, its mode's over recent
    sequences: `Drafter.acceptance`)."""
    lookup: ContextLookup = field(default_factory=ContextLookup)
    idle: int = 0
    """Steps since the last draft."""
    drafted: int = 0
    accepted: int = 0

    def limit(self, most: int, break_even: float) -> int:
        """How many tokens to draft now, of at most `most`: the recent acceptance's share
        of them, and no further than the draft's k-th token is kept with a better chance
        (about acceptance**k) than `break_even`, what a row costs this step in tokens
        (`step_cost.StepCost.break_even`)."""
        a = self.acceptance
        n = int(most * a + 0.5)
        if break_even > 0 and a < 1:
            n = min(n, int(math.log(break_even) / math.log(a)) if a > break_even else 0)
        if n == 0 and self.idle >= PROBE_EVERY and most > 0 and break_even < PROBE_ACCEPTANCE:
            return 1
        return n

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.acceptance += ACCEPTANCE_WEIGHT * (accepted / drafted - self.acceptance)
