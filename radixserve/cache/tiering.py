"""The tree's side of the disk tier: moving nodes' KV between memory and the disk store.

`RadixCache` is composed with one of two: `Tiering`, over a `DiskTier` (cache/disk.py, the
store's books), or `MemoryOnly`, for a cache without a disk tier, where nothing ever goes to
disk (eviction drops nodes, a match has no disk continuation). The cache calls the same
methods either way, so it has no "is there a disk tier" branches of its own.

How the tier works (node.py has the tree's part): eviction moves a node's KV to disk
instead of dropping it, and the node stays in the tree, on disk; the disk keeps its own LRU
order and drops whole disk leaves when full (`RadixCache.make_disk_room`). A match stops at
the first node on disk; `match` names the disk nodes that continue it, and a caller that
wants them locks the last (which keeps the whole path), allocates a block per page, asks
`load` for them and, once the worker has read them, calls `finish_load` (or, for an entry
that could not be read, `RadixCache.fail_load`, which drops it and what lies below it).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from typing import NoReturn

from radixserve.cache.disk import DiskTier
from radixserve.cache.events import EventLog, NoEventLog
from radixserve.cache.node import DiskMatch, RadixNode
from radixserve.cache.tree import RadixTree


class Tiering:
    """Moves ``tree``'s nodes between memory and ``disk``, keeping both books in step, and
    tells ``events`` of each move (and of each node restored on disk)."""

    def __init__(self, tree: RadixTree, disk: DiskTier, events: EventLog | NoEventLog) -> None:
        self.tree, self.disk, self.events = tree, disk, events

    def fits(self, pages: int) -> bool:
        """Whether an entry of ``pages`` fits in the store once enough others are dropped."""
        return self.disk.fits(pages)

    def over(self, pages: int) -> int:
        """Bytes to drop from the store before an entry of ``pages`` fits (<= 0: it fits)."""
        return self.disk.over(pages)

    def spill(self, node: RadixNode) -> None:
        """An evictable node's KV goes to a new disk entry (room made by the caller); its
        blocks are the caller's to free: the tree no longer holds them."""
        entry = self.disk.store(node.blocks.tolist(), node.hashes[-1], self.tree.page_size)
        self.tree.to_disk(node, entry)
        self.events.moved(node)

    def reclaim(self, node: RadixNode, blocks: array[int]) -> None:
        """A disk node's KV was computed again into ``blocks`` (the tree's references, taken
        by the caller): back to memory, and its disk entry is dropped."""
        entry = node.disk_id
        self.tree.to_memory(node, blocks)
        self.disk.drop(entry)
        self.events.moved(node)

    def forget(self, nodes: Iterable[RadixNode]) -> None:
        """``nodes`` have left the tree: drop the disk entries of those on disk."""
        for node in nodes:
            if node.on_disk:
                self.disk.drop(node.disk_id)

    def match(self, node: RadixNode, tokens: Sequence[int], start: int,
              max_len: int | None) -> DiskMatch:
        """See `RadixCache.match_disk`."""
        tree = self.tree
        limit = len(tokens) if max_len is None else min(max_len, len(tokens))
        limit -= limit % tree.page_size
        if start >= limit or not node.children:
            return DiskMatch([], 0)
        key = array("q", tokens[start:limit])
        found, pos = [], 0
        while pos < len(key):
            child = tree.next_child(node, key, pos)
            if child is None or not child.on_disk:
                break
            found.append(child)
            m = tree.match_len(child.tokens, key, pos, len(key))
            pos += m
            if m < len(child.tokens):
                break
            node = child
        return DiskMatch(found, pos)

    def load(self, match: DiskMatch, blocks: list[int]) -> None:
        """See `RadixCache.load`."""
        i = 0
        for node in match.nodes:
            pages = len(node.hashes)
            self.disk.load(node.disk_id, node.hashes[-1], blocks[i:i + pages])
            i += pages

    def finish_load(self, node: RadixNode, blocks: list[int]) -> bool:
        """See `RadixCache.finish_load`."""
        self.tree.check_live(node)
        if not node.on_disk:
            return False
        self.reclaim(node, array("q", blocks))
        self.disk.counters["disk_loads"] += 1
        self.disk.counters["disk_loaded_tokens"] += len(node.tokens)
        return True

    def load_failed(self) -> None:
        """Count a disk entry that could not be read back."""
        self.disk.counters["disk_load_failures"] += 1

    def restore(self, parent: RadixNode, tokens: array[int], entry: int,
                last_access: int) -> RadixNode:
        """See `RadixCache.restore_disk_node`."""
        node = self.tree.add_disk_leaf(parent, tokens, entry, last_access)
        self.disk.adopt(entry, len(node.hashes))
        self.events.stored(node)
        return node

    def stats(self) -> dict[str, int]:
        return self.disk.stats()


class MemoryOnly:
    """`Tiering` for a cache without a disk tier: nothing fits on disk, so nothing is ever
    there; the operations on disk nodes cannot be reached and raise."""

    def fits(self, pages: int) -> bool:
        return False

    def over(self, pages: int) -> int:
        return 0

    def forget(self, nodes: Iterable[RadixNode]) -> None:
        pass

    def match(self, node: RadixNode, tokens: Sequence[int], start: int,
              max_len: int | None) -> DiskMatch:
        return DiskMatch([], 0)

    def stats(self) -> dict[str, int]:
        return {}

    def _no_disk(self, *args: object) -> NoReturn:
        raise RuntimeError("this RadixCache has no disk tier")

    spill = reclaim = load = finish_load = load_failed = restore = _no_disk
