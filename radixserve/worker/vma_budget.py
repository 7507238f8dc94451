"""The virtual layout's memory-mapping budget on the CPU: how many kernel VMAs its views may
hold (`vm.max_map_count`), chosen at start-up and kept by admission.

The views are `regions` regions alike (one per layer's K and V, or one: `virtual_kv.py`),
and everything here is counted in *view mappings*, one region's VMAs: each stands for
`regions` kernel VMAs, plus the `regions - 1` guard pages between the regions. In a
region, every mapping of a block into a slot's view is a VMA. Adjacent positions holding
adjacent block ids merge into one, and so do adjacent stretches of the zero reserve, so a
running sequence whose block table is `r` runs of consecutive ids costs at most `r + 1`
view mappings (its runs, and the zero stretch after them). The views of all slots then
hold at most `sum(runs + 1) + 1` once no slot keeps a finished sequence's stale mappings
(the `+ 1`: the stretch before the first slot in use).

The budget is split in two, so that neither side has to see the other's state:

- the scheduler keeps `sum(runs + 1)` over its running sequences (the samples and beams a
  prompt will fork into counted at their worst) within `sequence_budget`: a sequence that
  would not fit waits, as one that would not fit in KV memory does, and a running one
  whose growth would not fit is retracted (scheduler/mappings.py);
- the worker keeps what it actually holds (the step's views, and the stale ones that
  deferred reclamation leaves for a slot's next sequence) within `views_budget`,
  reclaiming stale mappings first when a step would pass it (`VirtualKVPool.prepare`).

The worst case (`num_slots * slot_blocks` VMAs: every position a run of its own) no longer
has to fit; only one sequence of the whole context does, or nothing could ever run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

VMA_MARGIN = 1024
"""VMAs kept free for what the process maps later (threads' stacks, libraries, arenas)
and for a step's mappings in flight (a remap splits a VMA before the pieces merge)."""


def process_mappings() -> int:
    """The VMAs this process holds now (lines of /proc/self/maps)."""
    with open("/proc/self/maps", "rb") as f:
        return sum(1 for _ in f)


def max_map_count() -> int:
    with open("/proc/sys/vm/max_map_count") as f:
        return int(f.read())


def vma_starts(mapped: list[list[int]], lo: int, hi: int) -> int:
    """The VMAs that begin at view positions `lo .. hi-1` (counted over all slots, whose
    rows `mapped` holds: the block mapped at each position, or -1 for the zero reserve),
    by the kernel's merge rule: a position begins one unless it continues its
    predecessor's (both the zero reserve, or the next block id of the same pool)."""
    width = len(mapped[0])
    prev = mapped[(lo - 1) // width][(lo - 1) % width] if lo > 0 else None
    count = 0
    for i in range(lo, hi):
        b = mapped[i // width][i % width]
        count += prev is None or (b >= 0) != (prev >= 0) or (b >= 0 and b != prev + 1)
        prev = b
    return count


@dataclass(frozen=True)
class MappingBudget:
    """The budget chosen at start-up (`plan`)."""

    limit: int
    """The kernel's `vm.max_map_count` (or `virtual_max_map_count`)."""
    held: int
    """VMAs the process held before the pool was made."""
    views_budget: int
    """View mappings the slots' views may hold: the limit, less what the process holds,
    the pool's own mapping, the guard pages and `VMA_MARGIN`, over `regions`."""
    worst_case: int
    """The views' mappings if every position of every slot were a run of its own."""

    @property
    def sequence_budget(self) -> int:
        """What the scheduler's running sequences may cost (`sum(runs + 1)`)."""
        return self.views_budget - 1

    @property
    def binds(self) -> bool:
        """Whether admission can ever be held back by it (the worst case does not fit)."""
        return self.worst_case > self.views_budget

    @classmethod
    def plan(cls, num_slots: int, slot_blocks: int, page_size: int, limit: int | None = None,
             regions: int = 1) -> MappingBudget:
        """The budget for `num_slots` views of `slot_blocks` blocks in `regions` regions,
        logged with why. ValueError (naming the sysctl) when not even one sequence of the
        whole context fits: then nothing could be served."""
        limit = max_map_count() if limit is None else limit
        held = process_mappings()
        spare = 1 + VMA_MARGIN + regions - 1  # the pool's mapping, the margin, the guards
        budget = cls(limit, held, (limit - held - spare) // regions, num_slots * slot_blocks)
        alone = slot_blocks + 1  # a whole-context sequence, every block a run of its own
        per = (f"{regions} memory mappings each (one per layer's K and V), "
               if regions > 1 else "")
        if budget.sequence_budget < alone:
            needed = held + spare + regions * (alone + 1)
            raise ValueError(
                f"kv_layout='virtual' could not map even one sequence of the whole context "
                f"({slot_blocks} blocks of {page_size} tokens (context_length) need up to "
                f"{alone} view mappings, {per}{regions * alone} in all): the kernel's limit "
                f"of {limit} (vm.max_map_count) leaves {budget.sequence_budget} view "
                f"mappings after the {held} this process holds and {spare} spare; raise it "
                f"(sysctl -w vm.max_map_count={needed}) or lower context_length, or raise "
                f"page_size")
        chose = (f"kv_layout='virtual': a budget of {budget.views_budget} view mappings "
                 f"((vm.max_map_count {limit} - {held} held by the process - {spare} spare)"
                 f" / {regions} per view mapping)")
        if budget.binds:
            logger.info(
                "%s; the worst case (%d slots (max_running_requests) x %d blocks "
                "(context_length), each block a mapping of its own) would need %d, so "
                "admission counts each sequence's mappings and defers what would not fit",
                chose, num_slots, slot_blocks, budget.worst_case)
        else:
            logger.info("%s holds the worst case (%d slots x %d blocks): admission is never "
                        "held back by it", chose, num_slots, slot_blocks)
        return budget
