"""One sequence's speculation state (kept on its `Req`): its mode, its own context's
lookup, and how many tokens it may draft for its recent acceptance."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.speculative.lookup import ContextLookup

PROBE_EVERY = 16
"""Steps without a draft (for poor acceptance) before one token is tried again."""
ACCEPTANCE_WEIGHT = 0.5
"""Weight of the newest step in the running acceptance rate."""


@dataclass(eq=False)
class SeqDrafts:
    """One sequence's speculation: its mode, its own context's lookup, its acceptance."""

    mode: str
    lookup: ContextLookup = field(default_factory=ContextLookup)
    acceptance: float = 1.0
    """Running share of drafted tokens accepted (optimistic at the start)."""
    idle: int = 0
    """Steps since the last draft."""
    drafted: int = 0
    accepted: int = 0

    def limit(self, most: int) -> int:
        """How many tokens to draft now, of at most `most`."""
        n = int(most * self.acceptance + 0.5)
        return 1 if n == 0 and self.idle >= PROBE_EVERY and most > 0 else n

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.acceptance += ACCEPTANCE_WEIGHT * (accepted / drafted - self.acceptance)
