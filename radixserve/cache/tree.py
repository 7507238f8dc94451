"""The radix tree's structure and its incremental bookkeeping (base of `RadixCache`).

Split from `radix.py` so each file stays readable: this part knows edges, splits, the
LRU clock and the evictable-leaf set, but nothing about the allocator, locks' public
contract or statistics. Every primitive here keeps `evictable_blocks`, `locked_blocks`,
`cached_tokens` and the evictable set exact as it goes; nothing is ever rebuilt.

Namespaces (see node.py): a walk starts at its namespace's node instead of the root. A
namespace node is made by the first insert into its namespace, holds no blocks, is locked
and touched like any node on the paths below it, and, once childless and unlocked, is an
evictable leaf like any other (evicting it frees nothing and just forgets the namespace),
so the counters and the evictable set need no special case.

Tiers (see node.py): two eviction orders, both LRU and both kept exact as nodes change:
``_evictable``, the nodes that can leave memory (unlocked, in memory, no child in memory),
and ``_disk_evictable``, the nodes that can leave the disk store (unlocked disk leaves).
`_refile` is the one place that decides which order a node belongs in.
"""

from __future__ import annotations

from array import array

from sortedcontainers import SortedList

from radixserve.cache.events import page_hashes
from radixserve.cache.node import (DISK_LRU, MEMORY_LRU, ROOT_ID, UNFILED, ChildKey, Namespace,
                                   RadixNode)


class RadixTree:
    """Compressed-edge radix tree over token ids; edges are whole pages of tokens."""

    def __init__(self, page_size: int, hash_key: bytes = b"") -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.hash_key = hash_key
        """Keys the namespaces' page-hash seeds (the cache secret; see cache/events.py)."""
        self._clock = 0  # logical time; bumped once per match/insert
        self._now = 0.0  # time.monotonic() at the last bump: each touched node's last_used
        self._next_id = ROOT_ID + 1  # never reused, even across flush
        self._reset_tree()

    def _reset_tree(self) -> None:
        self._root = RadixNode(ROOT_ID, -1, array("q"), array("q"), array("q"), self._clock)
        self._nodes: dict[int, RadixNode] = {ROOT_ID: self._root}
        # Nodes that can leave memory, keyed (last_access, id): the eviction order, kept up
        # to date by every operation instead of being rebuilt (a per-call heap rebuild over
        # all leaves is what makes naive trees slow at millions of tokens).
        self._evictable: SortedList = SortedList()
        # Unlocked disk leaves, keyed the same way: the disk store's eviction order.
        self._disk_evictable: SortedList = SortedList()
        self.evictable_blocks = 0
        self.locked_blocks = 0
        self.cached_tokens = 0
        """Tokens whose KV is in memory."""
        self.disk_tokens = 0
        """Tokens of the tree's nodes on disk."""

    @property
    def root(self) -> RadixNode:
        return self._root

    @property
    def num_nodes(self) -> int:
        return len(self._nodes) - 1

    def _child_key(self, tokens: array[int], pos: int) -> ChildKey:
        if self.page_size == 1:
            return tokens[pos]
        return tuple(tokens[pos:pos + self.page_size])

    def _key_of(self, node: RadixNode) -> object:
        """The key ``node`` is filed under in its parent's children."""
        if node.namespace is not None:
            return node.namespace
        return self._child_key(node.tokens, 0)

    def _namespace_node(self, namespace: Namespace, create: bool) -> RadixNode | None:
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
            self._refile(node)  # childless, unlocked: it can go
        return node

    def _walk(self, key: array[int], limit: int, *, mutate: bool, out: array[int],
              start: RadixNode | None = None, offset: int = 0) -> tuple[RadixNode, int]:
        """Follow ``key[offset:limit]`` down the tree from ``start`` (the root, a namespace
        node, or the node that ends at ``offset``); append matched blocks to ``out``.

        Returns (node, matched length). With ``mutate``, a match ending inside an edge
        splits it there and the path (``start`` included) gets the current clock as its
        access time. Memory only: a walk stops where the next node is on disk.
        """
        ps = self.page_size
        limit -= limit % ps
        node, pos, clock = start or self._root, offset, self._clock
        if mutate and node.id != ROOT_ID:
            self._touch(node, clock)
        while pos < limit:
            child = node.children.get(self._child_key(key, pos))
            if child is None or child.on_disk:
                break
            edge = child.tokens
            m = self._match_len(edge, key, pos, limit)
            pos += m
            if m == len(edge):
                out.extend(child.blocks)
                if mutate:
                    self._touch(child, clock)
                node = child
                continue
            out.extend(child.blocks[:m // ps])
            if mutate:
                node = self._split(child, m)
                node.last_access = clock  # an inner node now: not in the evictable set
            else:
                node = child
            break
        return node, pos

    def _match_len(self, edge: array[int], key: array[int], pos: int, limit: int) -> int:
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

    def _split(self, node: RadixNode, at: int) -> RadixNode:  # in memory, not a namespace
        """Cut ``node``'s edge after ``at`` tokens; return the new upper node.

        ``node`` keeps the lower part, its id, lock count and access time, so handles to
        it, its evictable-set entry and both block counters all stay correct unchanged.
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
        upper.resident_children = 1  # node, in memory: upper can only go after it
        parent.children[self._child_key(upper.tokens, 0)] = upper
        node.tokens = node.tokens[at:]
        node.blocks = node.blocks[pages:]
        node.hashes = node.hashes[pages:]
        node.parent_id = upper.id
        upper.children[self._child_key(node.tokens, 0)] = node
        self._nodes[upper.id] = upper
        return upper

    def _add_leaf(self, parent: RadixNode, tokens: array[int], blocks: array[int]) -> RadixNode:
        """A new leaf below ``parent`` with its pages' hashes: chained on from the parent's
        last page, or from the namespace's seed below the root or a namespace node (which
        hold no pages; the root's ``namespace`` is None, the default namespace)."""
        if parent.hashes:
            hashes = page_hashes(tokens, self.page_size, parent=parent.hashes[-1])
        else:
            hashes = page_hashes(tokens, self.page_size, parent.namespace, key=self.hash_key)
        leaf = RadixNode(self._next_id, parent.id, tokens, blocks, array("q", hashes),
                         self._clock)
        self._next_id += 1
        leaf.last_used = self._now
        parent.children[self._child_key(tokens, 0)] = leaf
        parent.resident_children += 1
        self._refile(parent)  # it has a child in memory now: it stays while that does
        self._nodes[leaf.id] = leaf
        self._refile(leaf)
        self.evictable_blocks += len(blocks)
        self.cached_tokens += len(tokens)
        return leaf

    def _order_of(self, node: RadixNode) -> int:
        """Which eviction order ``node`` belongs in now. Unlocked nodes only: in memory,
        one without children in memory (its KV can go to disk, or a namespace node without
        any child, which holds nothing); on disk, a leaf."""
        if node.lock_count or node.id == ROOT_ID:
            return UNFILED
        if node.on_disk:
            return UNFILED if node.children else DISK_LRU
        if node.namespace is not None:
            return UNFILED if node.children else MEMORY_LRU
        return UNFILED if node.resident_children else MEMORY_LRU

    def _orders(self, filed: int) -> SortedList:
        return self._evictable if filed == MEMORY_LRU else self._disk_evictable

    def _refile(self, node: RadixNode) -> None:
        """Put ``node`` in the eviction order it belongs in (see `_order_of`), out of any
        other: called after anything that may change which that is."""
        want = self._order_of(node)
        if node.filed != want:
            if node.filed != UNFILED:
                self._orders(node.filed).remove((node.last_access, node.id))
            if want != UNFILED:
                self._orders(want).add((node.last_access, node.id))
            node.filed = want

    def _unfile(self, node: RadixNode) -> None:
        """Take ``node`` out of its eviction order (it is leaving the tree or its tier)."""
        if node.filed != UNFILED:
            self._orders(node.filed).remove((node.last_access, node.id))
            node.filed = UNFILED

    def _touch(self, node: RadixNode, clock: int) -> None:
        node.last_used = self._now
        if node.last_access == clock:
            return
        if node.filed != UNFILED:  # its sort key changes: re-file it
            order = self._orders(node.filed)
            order.remove((node.last_access, node.id))
            order.add((clock, node.id))
        node.last_access = clock

    def _check_live(self, node: RadixNode) -> None:
        if self._nodes.get(node.id) is not node:
            raise ValueError(f"stale node handle {node!r}: evicted or flushed (lock it "
                             "right after match_prefix/insert, before any evict)")

    def all_blocks(self) -> list[int]:
        """Every block id the tree holds in memory (each once): evictable plus locked."""
        return [b for node in self._nodes.values() for b in node.blocks]

    def page_hashes_in_tree(self) -> list[int]:
        """The page hash of every page the tree holds, in memory or on disk (each once, in
        no particular order): a snapshot of the set that `RadixCache.take_events` reports
        changes to. A page on disk counts: a request for it is a hit (it loads back)."""
        return [h for node in self._nodes.values() for h in node.hashes]
