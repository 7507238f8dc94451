"""The tree's two eviction orders: which nodes can leave which tier, least recently used first.

``memory``: the nodes that can leave memory (unlocked, in memory, no child in memory; or an
unlocked namespace node without children, which holds nothing). ``disk``: the nodes that can
leave the disk store (unlocked disk leaves). Both are keyed ``(last_access, id)`` and kept up
to date by every tree operation instead of being rebuilt: a per-call heap rebuild over all
leaves is what makes naive trees slow at millions of tokens. `order_of` is the one place that
decides which order a node belongs in; a node records the one it is in (``filed``), so moving
it is two O(log n) sorted-list updates.
"""

from __future__ import annotations

from collections.abc import Iterator

from sortedcontainers import SortedList

from radixserve.cache.node import DISK_LRU, MEMORY_LRU, ROOT_ID, UNFILED, RadixNode


def order_of(node: RadixNode) -> int:
    """Which eviction order ``node`` belongs in now (UNFILED, MEMORY_LRU or DISK_LRU).
    Unlocked nodes only: in memory, one without children in memory (its KV can go to disk,
    or a namespace node without any child, which holds nothing); on disk, a leaf."""
    if node.lock_count or node.id == ROOT_ID:
        return UNFILED
    if node.on_disk:
        return UNFILED if node.children else DISK_LRU
    if node.namespace is not None:
        return UNFILED if node.children else MEMORY_LRU
    return UNFILED if node.resident_children else MEMORY_LRU


class EvictionOrders:
    """The memory and disk LRU orders of one tree (see the module docstring). Holds node ids,
    not nodes: the tree resolves them, so a removed node must be `unfile`d first."""

    def __init__(self) -> None:
        self._memory: SortedList = SortedList()
        self._disk: SortedList = SortedList()

    def _order(self, filed: int) -> SortedList:
        return self._memory if filed == MEMORY_LRU else self._disk

    def refile(self, node: RadixNode) -> None:
        """Put ``node`` in the order it belongs in (see `order_of`), out of any other: called
        after anything that may change which that is."""
        want = order_of(node)
        if node.filed != want:
            if node.filed != UNFILED:
                self._order(node.filed).remove((node.last_access, node.id))
            if want != UNFILED:
                self._order(want).add((node.last_access, node.id))
            node.filed = want

    def unfile(self, node: RadixNode) -> None:
        """Take ``node`` out of its order (it is leaving the tree, or its tier)."""
        if node.filed != UNFILED:
            self._order(node.filed).remove((node.last_access, node.id))
            node.filed = UNFILED

    def touch(self, node: RadixNode, clock: int) -> None:
        """``node`` was accessed at logical time ``clock``: its sort key changes."""
        if node.last_access == clock:
            return
        if node.filed != UNFILED:
            order = self._order(node.filed)
            order.remove((node.last_access, node.id))
            order.add((clock, node.id))
        node.last_access = clock

    def oldest(self, filed: int) -> int | None:
        """The id of the least recently used node in order ``filed``; None if it is empty."""
        order = self._order(filed)
        return order[0][1] if order else None

    def entries(self, filed: int) -> Iterator[tuple[int, int]]:
        """Every ``(last_access, id)`` in order ``filed``, oldest first (for checks)."""
        return iter(self._order(filed))
