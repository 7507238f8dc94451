"""What one sequence holds of the KV pool: its `KVHandle`, and a prefix on its way back
from the disk tier for it (`PrefixLoad`).

Only the KV manager (scheduler/kv.py) changes a handle's blocks, lengths, node and load;
everything else reads them. Its block table changes through `KVManager.splice` alone, which
marks what the worker must be told again (`table_changed_from`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from radixserve.cache.node import DiskMatch, Namespace, RadixNode

UNCHANGED = 1 << 62
"""`KVHandle.table_changed_from` when the worker has every entry of the table."""

TokenReader = Callable[[int, int], list[int]]
"""A sequence's tokens `[start, end)` (`Req.tokens`): what the KV manager reads of it to
cache its pages, without building the whole list on every call."""


@dataclass(eq=False)
class KVHandle:
    """One sequence's KV in the pool.

    Ownership: the KV of the sequence's first `kv_len` tokens is in `block_table`'s blocks,
    in order, and the sequence owns ONE allocator reference per entry of `block_table` (a
    block shared with a fork or with the tree counts once per holder). The first
    `tree_len / page_size` entries are also the radix tree's blocks, on the path from the
    root to `node`, which the sequence keeps locked (one tree lock) for as long as `node`
    is set; the entries after them are the sequence's alone or shared with its forks by
    reference. A handle with no `node` holds nothing: empty table, lengths 0.

    `loading` is a prefix the disk tier reads back for the (waiting) sequence: it holds no
    blocks of the handle's, but its own lock on the tree (see `PrefixLoad`).
    """

    namespace: Namespace
    """The radix cache namespace of its request: every lookup, insert and kept partial
    block of this handle is in it alone."""
    block_table: list[int] = field(default_factory=list)
    table_changed_from: int = 0
    """The first entry of `block_table` that changed since the worker was last told the
    table (`scheduler/worker_rows.py`; `UNCHANGED` when none): `KVManager.splice` lowers
    it, the worker's account raises it once it has sent the entries."""
    kv_len: int = 0
    """Tokens whose KV is computed (or cached) in `block_table`."""
    tree_len: int = 0
    """Tokens of `block_table` that are the tree's (a multiple of the page size)."""
    node: RadixNode | None = None
    """Where the tree's part ends: the node this handle keeps locked (None: holds nothing)."""
    cached_tokens: int = 0
    """Tokens of the prompt the cache covered when the sequence was first admitted."""
    disk_tokens: int = 0
    """Tokens of its prefix that the disk tier loaded back for it."""
    loading: PrefixLoad | None = None
    """Its prefix load from the disk tier, in flight or held for it until it is admitted."""


@dataclass(eq=False)
class PrefixLoad:
    """A waiting sequence's prefix on its way back from the disk tier: `match`'s nodes, to
    be read into `blocks` (one per page, in order) by the step that carries it. The last
    node is locked (so the whole path is) until `DiskLoads.finish`."""

    handle: KVHandle
    match: DiskMatch
    entries: list[int]
    """Each node's disk entry when the load was asked for, as the worker reports them."""
    blocks: list[int]
    hold: RadixNode | None = None
    """Once loaded: the deepest node that came back, locked for `handle` until its sequence
    is admitted (see scheduler/kv.py)."""

    @property
    def pending(self) -> bool:
        """Asked for, and the step that reads it has not run yet."""
        return self.handle.loading is self and self.hold is None
