"""Tree attention: which sequences of a step share which runs of KV blocks.

A radix-cached system prompt sits at the same physical blocks at the start of every block
table that reuses it. Attending to it once per sequence reads it once per sequence; here
the sequences whose tables begin with the same blocks form a group, and the group's shared
run is attended once for all its queries (one matrix product per KV head, Hydragen /
FlashInfer cascade style), giving a partial output and its log-sum-exp. Within a group,
members that share more blocks after the run form sub-groups, to `max_levels` levels (a
trie over the block tables: system prompt -> few-shot set -> conversation). What is left
of each member after its deepest run is its *own* part, attended per sequence; the partials
are merged by log-sum-exp.

Only the block tables are needed: equal block ids at equal table positions hold the same
tokens at the same positions. A run covers only blocks that lie wholly before a sequence's
first new token, so nothing in it is written this step and its own part is never empty.
The planner is pure Python over the batch's lists, computed once per step for all layers,
and only for a step that `may_share`: tree attention is on by default, so a step that cannot
use it (fewer than `min_group_size` sequences with `min_shared_tokens` of KV before their new
tokens starting at one block: short contexts, a prefill of fresh prompts, no common prefix)
pays that O(batch) check alone.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from radixserve.config import EngineConfig


@dataclass(frozen=True)
class CascadeOptions:
    """The gates (`EngineConfig.cascade_*`, where their defaults live)."""

    max_levels: int
    min_shared_tokens: int
    min_group_size: int
    measured: bool = True
    """A plan that passes the gates must also pay by the costs the worker measures at
    start-up (`cascade_cost.py`; on every device). False: the gates alone decide."""

    @classmethod
    def from_config(cls, config: EngineConfig) -> CascadeOptions | None:
        """The config's gates, or None when tree attention is switched off."""
        if not config.enable_cascade_attention:
            return None
        return cls(config.cascade_max_levels, config.cascade_min_shared_tokens,
                   config.cascade_min_group_size, config.cascade_cost_model)

    def min_blocks(self, page_size: int) -> int:
        """The fewest whole blocks a shared run may have (at least `min_shared_tokens`)."""
        return max(1, -(-self.min_shared_tokens // page_size))


@dataclass
class SharedRun:
    """Blocks `blocks`, at table positions `block_start ..`, shared by every sequence in `seqs`."""

    seqs: list[int]
    block_start: int
    blocks: list[int]


@dataclass
class CascadePlan:
    levels: list[list[SharedRun]]
    """The runs of each level; a sequence is in at most one run per level, and its run at
    level l + 1 starts where its run at level l ends."""
    own_start: list[int]
    """Per sequence: the first token of its own part (0 for a sequence in no run)."""

    @property
    def num_runs(self) -> int:
        return sum(len(level) for level in self.levels)


def may_share(block_tables: list[list[int]], kv_lens: list[int], q_lens: list[int],
              page_size: int, options: CascadeOptions) -> bool:
    """Whether a group of the step could pass the gates, in O(batch): `min_group_size`
    sequences whose first block is the same, each with `min_shared_tokens` of KV before
    its new tokens. False means `plan_cascade` would return None (its first level needs
    such a group); True only that it may not."""
    least = options.min_blocks(page_size) * page_size
    firsts = [table[0] for table, kv, q in zip(block_tables, kv_lens, q_lens) if kv - q >= least]
    group = options.min_group_size
    # A group of `group` leaves at most len - group + 1 distinct first blocks; a set is
    # cheaper than counting, and settles the common case (no two tables begin alike).
    return (len(firsts) >= group and len(set(firsts)) <= len(firsts) - group + 1
            and max(Counter(firsts).values()) >= group)


def plan_cascade(block_tables: list[list[int]], kv_lens: list[int], q_lens: list[int],
                 page_size: int, options: CascadeOptions) -> CascadePlan | None:
    """Group the step's sequences by the block runs they share; None when no group passes
    the gates (the step then takes the plain path unchanged)."""
    # Blocks wholly before a sequence's first new token (never written this step).
    usable = [(kv - q) // page_size for kv, q in zip(kv_lens, q_lens)]
    min_blocks = options.min_blocks(page_size)
    own_start = [0] * len(block_tables)
    levels: list[list[SharedRun]] = []

    def split(members: list[int], depth: int, level: int) -> None:
        groups: dict[int, list[int]] = {}
        for s in members:
            if usable[s] >= depth + min_blocks:
                groups.setdefault(block_tables[s][depth], []).append(s)
        for group in groups.values():
            if len(group) < options.min_group_size:
                continue
            end = _shared_end(block_tables, usable, group, depth)
            if end - depth < min_blocks:
                continue
            if len(levels) == level:
                levels.append([])
            levels[level].append(SharedRun(group, depth, block_tables[group[0]][depth:end]))
            for s in group:
                own_start[s] = end * page_size
            if level + 1 < options.max_levels:
                split(group, end, level + 1)

    split(list(range(len(block_tables))), 0, 0)
    return CascadePlan(levels, own_start) if levels else None


def _shared_end(tables: list[list[int]], usable: list[int], group: list[int], depth: int) -> int:
    """End (exclusive table position) of the blocks every table of `group` has in common
    from `depth` on, within each one's usable blocks."""
    end = min(usable[s] for s in group)
    first = tables[group[0]]
    for s in group[1:]:
        table = tables[s]
        if table[depth:end] == first[depth:end]:  # the common case, compared in C
            continue
        j = depth
        while j < end and table[j] == first[j]:
            j += 1
        end = j
    return end
