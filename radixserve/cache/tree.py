"""The radix tree: edges, splits, namespaces, the LRU clock, locks, and each node's tier.

What it knows: the structure (each node's edge, children, tier), the path counters on nodes
(locks), the eviction orders (cache/lru.py) and the block and token counters. What it does
not: the allocator (whoever adds or removes blocks owns the references), the disk store's
books (cache/disk.py), events, pins, statistics; those are `RadixCache`'s and its
collaborators'. Every primitive here keeps `evictable_blocks`, `locked_blocks`,
`cached_tokens`, `disk_tokens` and the eviction orders exact as it goes; nothing is ever
rebuilt.

Namespaces (see node.py): a walk starts at its namespace's node instead of the root. A
namespace node is made by the first insert into its namespace, holds no blocks, is locked
and touched like any node on the paths below it, and, once childless and unlocked, is an
evictable leaf like any other (evicting it frees nothing and just forgets the namespace),
so the counters and the eviction orders need no special case.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Iterator
from typing import Literal, overload

from radixserve.cache.events import page_hashes
from radixserve.cache.lru import EvictionOrders
from radixserve.cache.node import (DISK_LRU, MEMORY_LRU, NOT_ON_DISK, ROOT_ID, ChildKey,
                                   Namespace, RadixNode)


class RadixTree:
    """Compressed-edge radix tree over token ids; edges are whole pages of tokens."""

    def __init__(self, page_size: int, hash_key: bytes = b"") -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.hash_key = hash_key
        """Keys the namespaces' page-hash seeds (the cache secret; see cache/events.py)."""
        self._clock = 0  # logical time; bumped once per match/insert (`tick`)
        self._now = 0.0  # time.monotonic() at the last tick: each touched node's last_used
        self._next_id = ROOT_ID + 1  # never reused, even across `reset`
        self.reset()

    def reset(self) -> None:
        """Empty the tree (the caller has dealt with its blocks and disk entries). The clock
        and node ids carry on, so a handle from before is detectably stale."""
        self._root = RadixNode(ROOT_ID, -1, array("q"), array("q"), array("q"), self._clock)
        self._nodes: dict[int, RadixNode] = {ROOT_ID: self._root}
        self._lru = EvictionOrders()
        self.evictable_blocks = 0
        """Blocks in memory on unlocked nodes."""
        self.locked_blocks = 0
        """Blocks in memory on locked nodes."""
        self.cached_tokens = 0
        """Tokens whose KV is in memory."""
        self.disk_tokens = 0
        """Tokens of the tree's nodes on disk."""

    # ---------------------------------------------------------------- reading

    @property
    def root(self) -> RadixNode:
        return self._root

    @property
    def num_nodes(self) -> int:
        """Nodes other than the root (namespace nodes included)."""
        return len(self._nodes) - 1

    def nodes(self) -> Iterator[RadixNode]:
        """Every node of the tree, the root first, then in no particular order. The tree
        must not change while this is iterated."""
        return iter(self._nodes.values())

    def parent(self, node: RadixNode) -> RadixNode:
        """``node``'s parent (nodes store their parent's id, not a reference: node.py)."""
        return self._nodes[node.parent_id]

    def path(self, node: RadixNode) -> Iterator[RadixNode]:
        """``node`` and its ancestors, bottom up, the root excluded."""
        nodes = self._nodes
        while node.id != ROOT_ID:
            yield node
            node = nodes[node.parent_id]

    def is_live(self, node: RadixNode) -> bool:
        """Whether ``node`` is still in the tree (not evicted, dropped or flushed)."""
        return self._nodes.get(node.id) is node

    def check_live(self, node: RadixNode) -> None:
        """Raise ValueError for a handle to a node no longer in the tree."""
        if self._nodes.get(node.id) is not node:
            raise ValueError(f"stale node handle {node!r}: evicted or flushed (lock it "
                             "right after match_prefix/insert, before any evict)")

    def child_key(self, tokens: array[int], pos: int) -> ChildKey:
        """The key of the child that ``tokens[pos:]`` continues into: its first page."""
        if self.page_size == 1:
            return tokens[pos]
        return tuple(tokens[pos:pos + self.page_size])

    def all_blocks(self) -> list[int]:
        """Every block id the tree holds in memory (each once): evictable plus locked."""
        return [b for node in self._nodes.values() for b in node.blocks]

    def page_hashes_in_tree(self) -> list[int]:
        """The page hash of every page the tree holds, in memory or on disk (each once, in
        no particular order): a snapshot of the set that `RadixCache.take_events` reports
        changes to. A page on disk counts: a request for it is a hit (it loads back)."""
        return [h for node in self._nodes.values() for h in node.hashes]

    # ---------------------------------------------------------------- the clock

    @property
    def clock(self) -> int:
        """The logical time of the last `tick`: what orders accesses (runs are
        deterministic; wall time is only reported, as nodes' ``last_used``)."""
        return self._clock

    def tick(self) -> None:
        """A new access (one match or insert): whatever it touches is the most recent."""
        self._clock += 1
        self._now = time.monotonic()

    def advance_clock(self, to: int) -> None:
        """Carry on from logical time ``to`` (a tree resumed from saved access times)."""
        self._clock = max(self._clock, to)

    # ---------------------------------------------------------------- walking

    @overload
    def namespace_node(self, namespace: Namespace, create: Literal[True]) -> RadixNode: ...
    @overload
    def namespace_node(self, namespace: Namespace, create: bool) -> RadixNode | None: ...

    def namespace_node(self, namespace: Namespace, create: bool) -> RadixNode | None:
        """Where the walks of ``namespace`` start: the root for the default namespace, else
        its namespace node (made now if ``create``; None if it has none)."""
        if namespace is None:
            return self._root
        if not isinstance(namespace, str) or not namespace:
            raise ValueError(f"a cache namespace is None or a non-empty str, got {namespace!r}")
        node = self._root.children.get(namespace)
        if node is None and create:
            node = RadixNode(self._next_id, ROOT_ID, array("q"), array("q"), array("q"),
                             self._clock, namespace=namespace)
            self._next_id += 1
            self._root.children[namespace] = node
            self._nodes[node.id] = node
            self._lru.refile(node)  # childless, unlocked: it can go
        return node

    def walk(self, key: array[int], limit: int, *, mutate: bool, out: array[int],
             start: RadixNode, offset: int = 0) -> tuple[RadixNode, int]:
        """Follow ``key[offset:limit]`` down the tree from ``start`` (the root, a namespace
        node, or the node that ends at ``offset``); append matched blocks to ``out``.

        Returns (node, matched length). With ``mutate``, a match ending inside an edge
        splits it there and the path (``start`` included) gets the current clock as its
        access time. Memory only: a walk stops where the next node is on disk.
        """
        ps = self.page_size
        limit -= limit % ps
        node, pos, clock, now, touch = start, offset, self._clock, self._now, self._lru.touch
        if mutate and node.id != ROOT_ID:
            node.last_used = now
            touch(node, clock)
        while pos < limit:
            child = node.children.get(self.child_key(key, pos))
            if child is None or child.on_disk:
                break
            edge = child.tokens
            m = self.match_len(edge, key, pos, limit)
            pos += m
            if m == len(edge):
                out.extend(child.blocks)
                if mutate:
                    child.last_used = now
                    touch(child, clock)
                node = child
                continue
            out.extend(child.blocks[:m // ps])
            if mutate:
                node = self._split(child, m)
                node.last_access = clock  # an inner node now: in no eviction order
            else:
                node = child
            break
        return node, pos

    def next_child(self, node: RadixNode, key: array[int], pos: int) -> RadixNode | None:
        """The child of ``node`` that ``key[pos:]`` continues into, if any (where a walk
        stopped, that is a node on disk, or none)."""
        return node.children.get(self.child_key(key, pos))

    def match_len(self, edge: array[int], key: array[int], pos: int, limit: int) -> int:
        """Whole-page length of the common prefix of ``edge`` and ``key[pos:limit]``.

        The child lookup already proved the first page equal. Array slice comparison runs
        in C, so we test the whole overlap at once and binary-search pages only on a
        mismatch: O(log pages) Python steps instead of one per token.
        """
        ps = self.page_size
        n = min(len(edge), limit - pos)  # page-aligned: both operands are
        if key[pos:pos + n] == (edge if n == len(edge) else edge[:n]):
            return n
        lo, hi = 1, n // ps  # pages known equal / known unequal
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if key[pos:pos + mid * ps] == edge[:mid * ps]:
                lo = mid
            else:
                hi = mid
        return lo * ps

    # ---------------------------------------------------------------- growing

    def _split(self, node: RadixNode, at: int) -> RadixNode:  # in memory, not a namespace
        """Cut ``node``'s edge after ``at`` tokens; return the new upper node.

        ``node`` keeps the lower part, its id, lock count and access time, so handles to
        it, its eviction-order entry and both block counters all stay correct unchanged.
        Page hashes name whole prefixes, so each page keeps its hash: they are cut along
        with the blocks.
        """
        parent = self._nodes[node.parent_id]
        pages = at // self.page_size
        upper = RadixNode(self._next_id, node.parent_id, node.tokens[:at], node.blocks[:pages],
                          node.hashes[:pages], node.last_access)
        self._next_id += 1
        upper.lock_count = node.lock_count  # every lock through node passes through upper
        upper.pin_count, upper.hits = node.pin_count, node.hits  # and every pin and hit
        upper.last_used = node.last_used
        upper.indexed = node.indexed  # a token index counted both halves or neither
        upper.resident_children = 1  # node, in memory: upper can only go after it
        parent.children[self.child_key(upper.tokens, 0)] = upper
        node.tokens = node.tokens[at:]
        node.blocks = node.blocks[pages:]
        node.hashes = node.hashes[pages:]
        node.parent_id = upper.id
        upper.children[self.child_key(node.tokens, 0)] = node
        self._nodes[upper.id] = upper
        return upper

    def add_leaf(self, parent: RadixNode, tokens: array[int], blocks: array[int]) -> RadixNode:
        """A new leaf in memory below ``parent``, holding ``blocks`` (the caller has taken
        the tree's references), with its pages' hashes: chained on from the parent's last
        page, or from the namespace's seed below the root or a namespace node (which hold
        no pages; the root's ``namespace`` is None, the default namespace)."""
        if parent.hashes:
            hashes = page_hashes(tokens, self.page_size, parent=parent.hashes[-1])
        else:
            hashes = page_hashes(tokens, self.page_size, parent.namespace, key=self.hash_key)
        leaf = RadixNode(self._next_id, parent.id, tokens, blocks, array("q", hashes),
                         self._clock)
        self._next_id += 1
        leaf.last_used = self._now
        parent.children[self.child_key(tokens, 0)] = leaf
        parent.resident_children += 1
        self._lru.refile(parent)  # it has a child in memory now: it stays while that does
        self._nodes[leaf.id] = leaf
        self._lru.refile(leaf)
        self.evictable_blocks += len(blocks)
        self.cached_tokens += len(tokens)
        return leaf

    def add_disk_leaf(self, parent: RadixNode, tokens: array[int], entry: int,
                      last_access: int) -> RadixNode:
        """A new leaf below ``parent`` whose KV is the disk store's ``entry`` (a tree
        resumed from its saved index), last accessed at ``last_access``."""
        node = self.add_leaf(parent, tokens, array("q"))
        self._lru.unfile(node)  # before its sort key changes
        node.last_access = last_access
        self._to_tier(node, entry, array("q"))
        return node

    # ---------------------------------------------------------------- locks

    def lock(self, node: RadixNode) -> None:
        """One more lock on ``node`` and each ancestor (the root holds none)."""
        if node.id == ROOT_ID:
            return
        self.check_live(node)
        nodes = self._nodes
        while node.id != ROOT_ID:
            node.lock_count += 1
            if node.lock_count == 1:
                n = len(node.blocks)
                self.evictable_blocks -= n
                self.locked_blocks += n
                self._lru.unfile(node)
            node = nodes[node.parent_id]

    def unlock(self, node: RadixNode) -> None:
        """Undo one `lock(node)`; raises RuntimeError if ``node`` is not locked."""
        if node.id == ROOT_ID:
            return
        self.check_live(node)
        # Ancestors' counts are >= node's, so checking node alone keeps this atomic.
        if node.lock_count <= 0:
            raise RuntimeError(f"unlock of unlocked node {node!r}")
        nodes = self._nodes
        while node.id != ROOT_ID:
            node.lock_count -= 1
            if node.lock_count == 0:
                n = len(node.blocks)
                self.locked_blocks -= n
                self.evictable_blocks += n
                self._lru.refile(node)
            node = nodes[node.parent_id]

    # ---------------------------------------------------------------- eviction orders

    def oldest_in_memory(self) -> RadixNode | None:
        """The least recently used node that can leave memory (None: there is none)."""
        node_id = self._lru.oldest(MEMORY_LRU)
        return None if node_id is None else self._nodes[node_id]

    def oldest_on_disk(self) -> RadixNode | None:
        """The least recently used disk leaf that can leave the disk store."""
        node_id = self._lru.oldest(DISK_LRU)
        return None if node_id is None else self._nodes[node_id]

    def eviction_order(self, filed: int) -> list[tuple[int, int]]:
        """``(last_access, id)`` of every node in order ``filed`` (MEMORY_LRU or DISK_LRU),
        oldest first: for checks (see `lru.order_of` for which nodes belong)."""
        return list(self._lru.entries(filed))

    # ---------------------------------------------------------------- tiers and removal

    def to_disk(self, node: RadixNode, entry: int) -> None:
        """An evictable node's KV is now the disk store's ``entry``: the node stays, on
        disk, and its blocks are the caller's to free (the tree no longer holds them)."""
        self._to_tier(node, entry, array("q"))

    def to_memory(self, node: RadixNode, blocks: array[int]) -> None:
        """A disk node's KV is in ``blocks`` now (the tree's references, taken by the
        caller); its disk entry is the caller's to drop."""
        self._to_tier(node, NOT_ON_DISK, blocks)

    def _to_tier(self, node: RadixNode, entry: int, blocks: array[int]) -> None:
        """Move ``node`` between memory (``entry`` NOT_ON_DISK, KV in ``blocks``) and disk
        (KV in ``entry``, ``blocks`` empty), keeping the counters and orders exact."""
        sign = 1 if entry == NOT_ON_DISK else -1  # +1: to memory; -1: to disk
        self._lru.unfile(node)
        moved = len(node.blocks) + len(blocks)  # one of them is empty
        node.disk_id, node.blocks = entry, blocks
        if node.lock_count:
            self.locked_blocks += sign * moved
        else:
            self.evictable_blocks += sign * moved
        self.cached_tokens += sign * len(node.tokens)
        self.disk_tokens -= sign * len(node.tokens)
        parent = self._nodes[node.parent_id]
        parent.resident_children += sign
        self._lru.refile(parent)
        self._lru.refile(node)

    def detach(self, top: RadixNode) -> list[RadixNode]:
        """Take ``top`` and everything below it out of the tree (all unlocked: a lock below
        would lock ``top``); returns the removed nodes. Their memory blocks and disk entries
        are the caller's to free and drop (only ``top`` can have blocks: whatever is below a
        node that may go is on disk). A namespace node left empty goes too, unreported: it
        holds nothing."""
        nodes, orders = self._nodes, self._lru
        parent = nodes[top.parent_id]
        del parent.children[top.namespace if top.namespace is not None
                            else self.child_key(top.tokens, 0)]
        if not top.on_disk and not top.is_namespace:
            parent.resident_children -= 1
        removed, stack = [], [top]
        while stack:
            node = stack.pop()
            removed.append(node)
            stack.extend(node.children.values())
            orders.unfile(node)
            del nodes[node.id]
            if node.on_disk:
                self.disk_tokens -= len(node.tokens)
            else:
                self.evictable_blocks -= len(node.blocks)
                self.cached_tokens -= len(node.tokens)
        if parent.namespace is not None and not parent.children and not parent.lock_count:
            orders.unfile(parent)  # an emptied namespace node
            del nodes[parent.id], self._root.children[parent.namespace]
        else:
            orders.refile(parent)
        return removed
