"""The virtual KV layout's memory-mapping budget, as admission keeps it.

On the CPU each running sequence's view maps its blocks as kernel VMAs, at most its block
table's runs of consecutive ids plus one zero stretch, in each region of the views; all
counts here are of one region's (view mappings: worker/vma_budget.py says why, and how the
worker keeps its stale views within the rest). The scheduler keeps what its
running sequences cost within the budget the worker chose, as it keeps their KV within the
pool: a waiting sequence that would not fit stays queued, a running one whose growth would
not fit is retracted (scheduler.py). Counted where it is decided, the worst case (every
block a run of its own, every slot full) never has to fit at once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from radixserve.scheduler.features import StepFeature
from radixserve.scheduler.request import Req

if TYPE_CHECKING:
    from radixserve.messages import ForwardResult
    from radixserve.scheduler.batch import ScheduledBatch


def table_runs(table: list[int]) -> int:
    """Runs of consecutive block ids in a block table: the VMAs its view maps."""
    return sum(b != a + 1 for a, b in zip(table, table[1:])) + bool(table)


class MappingAccount(StepFeature):
    """The running sequences' mappings against the worker's budget. A layout without
    kernel mappings (`kv_layout="paged"`, budget 0) keeps no account at all (`for_budget`),
    so nothing here runs per step when it has nothing to count. Its hook: `folded` (what
    the worker's views map now)."""

    def __init__(self, views_budget: int) -> None:
        """`views_budget`: the VMAs the worker's views may hold (`WorkerInfo`), above 0."""
        self.views_budget = views_budget
        self.budget = max(0, views_budget - 1)
        """What the sequences may cost: the views' budget less the zero stretch before the
        first slot in use."""
        self.in_use = 0
        """The VMAs the worker's views held after the last step (or release)."""

    def folded(self, batch: ScheduledBatch, result: ForwardResult | None) -> set[int]:
        if result is not None:
            self.in_use = result.kv_mappings
        return set()

    @staticmethod
    def cost(req: Req) -> int:
        """What `req`'s views may map now: its table's runs and its zero stretch, once per
        sequence it stands for (the samples or beams it forks into share its table)."""
        return (table_runs(req.kv.block_table) + 1) * req.group.queued_width

    def fits(self, running: Iterable[Req], extra: int = 0) -> bool:
        """Whether the `running` sequences, and `extra` more VMAs, fit the budget."""
        running = list(running)
        # Each block a run of its own bounds the count, and is cheap: most steps stop here.
        bound = sum((len(r.kv.block_table) + 1) * r.group.queued_width for r in running)
        if bound + extra <= self.budget:
            return True
        return sum(map(self.cost, running)) + extra <= self.budget

    def admits(self, running: list[Req], req: Req) -> bool:
        """Whether `req`, its blocks for this step taken, fits beside `running`; alone it
        always does (what the worker cannot map at all it refused at start-up)."""
        return not running or self.fits(running, self.cost(req))

    def grows(self, running: list[Req], req: Req, new_blocks: int) -> bool:
        """Whether running `req` may take `new_blocks` more blocks: when they fit, and
        always for the oldest running sequence (alone it always fits, so some sequence
        always makes progress)."""
        return req is running[0] or self.fits(running, new_blocks)

    @classmethod
    def for_budget(cls, views_budget: int) -> MappingAccount | None:
        """The account for the worker's budget; None when it has none (0: no limit)."""
        return cls(views_budget) if views_budget else None

    def stats(self) -> dict[str, int]:
        return {"kv_mappings": self.in_use, "kv_mapping_budget": self.views_budget}


def mapping_stats(account: MappingAccount | None) -> dict[str, int]:
    """The stats' mapping counts; zeros for a layout without kernel mappings."""
    return account.stats() if account else {"kv_mappings": 0, "kv_mapping_budget": 0}
