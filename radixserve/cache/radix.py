"""RadixCache: one global radix tree over token ids, mapping cached prefixes to KV blocks.

How a scheduler uses it (the lock/match/insert/evict contract):

1. ``m = cache.match_prefix(tokens, max_len)``: ``m.blocks`` hold ``tokens[:m.length]``.
2. ``cache.lock(m.node)`` before anything may call ``evict``; a locked path is never evicted.
   Take a reference to each of ``m.blocks`` (``allocator.incref``) to use them.
3. Allocate private blocks for the rest (on failure ``cache.evict(n)`` and retry).
4. When a sequence (or a prefill chunk) is done: ``r = cache.insert(tokens, table)``;
   where ``r.blocks`` differs from the caller's table, the caller's block is a duplicate:
   take a reference to the canonical block and drop the duplicate; ``lock(r.node)`` if
   still running, then ``unlock(m.node)``.

Ownership: every holder of a block owns one allocator reference to it. The tree holds one
for each block in it (taken by `insert` for every block it adopts, given back by eviction
and `flush`); a caller holds its own for each block in its table, matched or computed.
Locks are separate: they keep the tree's part of a running request's path from eviction,
so an evictable block's only holder is the tree, and evicting it frees it.

Namespaces: every lookup and insert names a namespace (``None``, the default, or an
opaque string; the server derives it from the caller's tenant and ``cache_salt``). The
namespace is part of the key from the root: each non-default namespace has its own
empty-edged root child (see node.py), so a match in one namespace never sees, splits or
refreshes another's prefixes, and the same tokens inserted in two namespaces are two
copies with their own blocks. Locks, eviction (one global LRU order over all namespaces:
the pool is shared), flush and the block accounting are namespace-blind, because a
namespace node holds no blocks.

Pins: `pin(node)` is a lock that no request owns: it keeps the prefix ending at ``node``
from eviction until `unpin(node)`. Each node also counts the pins on it or below
(``pin_count``, part of its ``lock_count``), so `pinned_tokens` and `flush` can tell pins
from the locks of running requests. What a pin is for (its tokens, its expiry) is the
caller's (scheduler/pins.py); the cache only holds it.

Events (for a cache-aware router, see cache/events.py): with ``record_events``, the cache
remembers the page hashes that entered the tree (a leaf added by `insert`), left it (a
node evicted) and whether it was flushed, until `take_events` hands them over. A split
changes no page's hash, so it is no event. Kept opt-in because nothing else drains them.

Eviction removes whole leaves, least recently used first (a logical clock orders accesses,
so runs are deterministic). A whole leaf may free more blocks than asked for; we accept
that rather than trimming leaves from the tail, because a trimmed node would silently
change what an outstanding handle to it means, while a removed node is detectably stale.
"""

from __future__ import annotations

import sys
import time
from array import array
from collections.abc import Callable, Sequence

from radixserve.cache.allocator import BlockAllocator
from radixserve.cache.invariants import check_radix_invariants
from radixserve.cache.node import (ROOT_ID, InsertResult, MatchResult, Namespace, RadixNode,
                                   TreeEvents)
from radixserve.cache.summary import summarize
from radixserve.cache.tree import RadixTree


class RadixCache(RadixTree):
    """Prefix cache of KV blocks; see the module docstring for the calling contract.

    ``enabled=False`` turns caching off without changing the caller's code path: matches
    are empty (at the root), inserts adopt nothing (the canonical blocks are the caller's),
    and lock/unlock of the root are no-ops. Such a tree stays empty, so it has no events.

    ``record_events=True``: keep what enters and leaves the tree for `take_events`, whose
    caller must then drain it (it grows until taken).
    """

    def __init__(self, allocator: BlockAllocator, page_size: int, enabled: bool = True,
                 record_events: bool = False) -> None:
        super().__init__(page_size)
        self.allocator = allocator
        self.enabled = enabled
        self.record_events = record_events
        self.hit_tokens = 0
        self.miss_tokens = 0
        self.evicted_tokens = 0
        self.pinned_tokens = 0
        """Tokens on nodes held by at least one pin (each counted once)."""
        # Pending events, as ordered sets (dicts): see `take_events` for their meaning.
        self._stored: dict[int, None] = {}
        self._removed: dict[int, None] = {}
        self._cleared = False

    # ---------------------------------------------------------------- lookup / insert

    def match_prefix(self, tokens: Sequence[int], max_len: int | None = None, *,
                     peek: bool = False, namespace: Namespace = None) -> MatchResult:
        """Longest cached prefix of ``tokens[:max_len]`` in ``namespace``, rounded down to
        whole pages (a namespace nothing was inserted in matches nothing, at the root).

        The caller chooses ``max_len`` (e.g. ``len(tokens) - 1`` so at least one token is
        computed for logits); the cache only rounds down. A non-peek match splits the edge
        where the match ends (so ``node`` ends exactly at ``length``) and refreshes the LRU
        time of the path. ``peek=True`` changes nothing: for
        policies that only want the length (its ``node`` must not be locked).
        """
        limit = len(tokens) if max_len is None else max(0, min(max_len, len(tokens)))
        if not self.enabled:
            return MatchResult([], self._root, 0)
        start = self._namespace_node(namespace, create=False)
        if start is None:
            return MatchResult([], self._root, 0)
        key = array("q", tokens[:limit])
        if not peek:
            self._clock += 1
            self._now = time.monotonic()
        out = array("q")
        node, length = self._walk(key, limit, mutate=not peek, out=out, start=start)
        return MatchResult(out.tolist(), node, length)

    def record_lookup(self, hit: int, looked_up: int) -> None:
        """Count one request's lookup for `stats()`: `hit` of its `looked_up` tokens were
        cached. The caller counts each request once (a match is repeated whenever an
        admission has to be retried, so matches themselves are not counted)."""
        self.hit_tokens += hit
        self.miss_tokens += looked_up - hit

    def insert(self, tokens: Sequence[int], blocks: Sequence[int], *,
               namespace: Namespace = None) -> InsertResult:
        """Add ``tokens`` (whole pages) whose KV lives in ``blocks`` (one per page) to
        ``namespace`` (made on its first insert).

        The already-cached part is not re-added; ``result.blocks`` names the canonical
        block of every page. The tree takes its own reference to each block it adopts; the
        caller's references are untouched. Refreshes the path's LRU.
        """
        n, ps = len(tokens), self.page_size
        if n % ps:
            raise ValueError(f"insert of {n} tokens: not a multiple of page_size {ps}")
        if len(blocks) != n // ps:
            raise ValueError(f"insert of {n} tokens needs {n // ps} blocks, got {len(blocks)}")
        if not self.enabled:
            return InsertResult(n, list(blocks), self._root)
        if n == 0:
            self._namespace_node(namespace, create=False)  # still checks the namespace
            return InsertResult(0, [], self._root)
        key = array("q", tokens)
        self._clock += 1
        self._now = time.monotonic()
        canonical = array("q")
        start = self._namespace_node(namespace, create=True)
        node, pos = self._walk(key, n, mutate=True, out=canonical, start=start)
        if pos < n:
            adopted = array("q", blocks[pos // ps:])
            self.allocator.incref(adopted)
            node = self._add_leaf(node, key[pos:], adopted)
            canonical.extend(adopted)
            if self.record_events:
                self._stored.update(dict.fromkeys(node.hashes))
        return InsertResult(pos, canonical.tolist(), node)

    # ---------------------------------------------------------------- locks

    def lock(self, node: RadixNode) -> None:
        """Protect the prefix ending at ``node`` (node and ancestors) from eviction."""
        if node.id == ROOT_ID:
            return
        self._check_live(node)
        nodes = self._nodes
        while node.id != ROOT_ID:
            if node.lock_count == 0:
                n = len(node.blocks)
                self.evictable_blocks -= n
                self.locked_blocks += n
                if not node.children:
                    self._evictable.remove((node.last_access, node.id))
            node.lock_count += 1
            node = nodes[node.parent_id]

    def unlock(self, node: RadixNode) -> None:
        """Undo one `lock(node)`; raises if ``node`` is not locked."""
        if node.id == ROOT_ID:
            return
        self._check_live(node)
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
                if not node.children:
                    self._evictable.add((node.last_access, node.id))
            node = nodes[node.parent_id]

    # ---------------------------------------------------------------- pins

    def pin(self, node: RadixNode) -> None:
        """Keep the prefix ending at ``node`` cached until the matching `unpin`: a lock
        (so eviction skips it) that is also counted as a pin along the path."""
        if node.id == ROOT_ID:
            raise ValueError("pin of the root: an empty prefix")
        self.lock(node)
        nodes = self._nodes
        while node.id != ROOT_ID:
            if node.pin_count == 0:
                self.pinned_tokens += len(node.tokens)
            node.pin_count += 1
            node = nodes[node.parent_id]

    def unpin(self, node: RadixNode) -> None:
        """Undo one `pin(node)`; raises if ``node`` is not pinned."""
        self._check_live(node)
        if node.pin_count <= 0:
            raise RuntimeError(f"unpin of unpinned node {node!r}")
        n, nodes = node, self._nodes
        while n.id != ROOT_ID:
            n.pin_count -= 1
            if n.pin_count == 0:
                self.pinned_tokens -= len(n.tokens)
            n = nodes[n.parent_id]
        self.unlock(node)

    def unpinned_tokens(self, node: RadixNode) -> int:
        """Tokens of the prefix ending at ``node`` that no pin holds yet: what pinning it
        would add to `pinned_tokens`."""
        total, nodes = 0, self._nodes
        while node.id != ROOT_ID:
            if node.pin_count == 0:
                total += len(node.tokens)
            node = nodes[node.parent_id]
        return total

    def record_hit(self, node: RadixNode) -> None:
        """Count one request whose cached prefix ended at ``node`` (once per request, as
        `record_lookup`): every node of the path gets a hit."""
        nodes = self._nodes
        while node.id != ROOT_ID:
            node.hits += 1
            node = nodes[node.parent_id]

    # ---------------------------------------------------------------- eviction

    def evict(self, num_blocks: int) -> int:
        """Free at least ``num_blocks`` blocks if that many are evictable; return freed.

        Least recently used unlocked leaves go first, whole; a parent left childless (and
        unlocked) joins the candidates. Its access time is >= its children's, so it is
        considered no earlier than they were; a namespace node left so goes at once (it
        holds no block). May free more than asked, or fewer.
        """
        evictable, nodes = self._evictable, self._nodes
        freed: list[int] = []
        while len(freed) < num_blocks and evictable:
            _, nid = evictable.pop(0)
            node = nodes.pop(nid)
            parent = nodes[node.parent_id]
            del parent.children[self._key_of(node)]
            freed.extend(node.blocks)
            if self.record_events:
                self._record_removed(node)
            self.evictable_blocks -= len(node.blocks)
            self.cached_tokens -= len(node.tokens)
            self.evicted_tokens += len(node.tokens)
            if self._is_evictable(parent):
                if parent.is_namespace:  # holds nothing: forget the namespace at once
                    del nodes[parent.id], self._root.children[parent.namespace]
                else:
                    evictable.add((parent.last_access, parent.id))
        self.allocator.free(freed)
        return len(freed)

    def flush(self) -> None:
        """Free every block in the tree that no pin holds; raises if a running request
        holds a lock. Pinned prefixes stay (a pin is a promise to keep them: unpin to drop
        them); without pins the tree is emptied and reports `cleared`, with pins every
        other node is evicted and reported removed."""
        roots = self._root.children.values()
        if any(c.lock_count > c.pin_count for c in roots):
            raise RuntimeError("flush with locked nodes (requests still running)")
        if any(c.pin_count for c in roots):
            self.evict(sys.maxsize)  # everything unlocked: every node no pin holds
            return
        blocks = self.all_blocks()
        self._reset_tree()
        self.allocator.free(blocks)
        if self.record_events and self.enabled:
            # Everything before the flush is void: `cleared` says so on its own.
            self._stored.clear()
            self._removed.clear()
            self._cleared = True

    # ---------------------------------------------------------------- events

    def _record_removed(self, node: RadixNode) -> None:
        """``node`` left the tree. Its hashes are reported removed even when they were
        stored since the last `take_events` (not just dropped from the stored ones): a
        subscriber may hold them from a snapshot taken in between."""
        stored, removed = self._stored, self._removed
        for h in node.hashes:
            stored.pop(h, None)
            removed[h] = None

    def take_events(self) -> TreeEvents:
        """What entered and left the tree since the previous call (see `TreeEvents`), and
        forget it. A hash stored after being removed is in both lists (removed, then
        stored: it is in the tree); one removed after being stored is only in `removed`.
        Raises RuntimeError unless the cache records events."""
        if not self.record_events:
            raise RuntimeError("this RadixCache does not record events (record_events=False)")
        events = TreeEvents(list(self._stored), list(self._removed), self._cleared)
        self._stored, self._removed, self._cleared = {}, {}, False
        return events

    # ---------------------------------------------------------------- introspection

    def stats(self) -> dict[str, int | float]:
        looked_up = self.hit_tokens + self.miss_tokens
        return {
            "enabled": int(self.enabled),
            "num_nodes": self.num_nodes,
            "cached_tokens": self.cached_tokens,
            "evictable_blocks": self.evictable_blocks,
            "locked_blocks": self.locked_blocks,
            "hit_tokens": self.hit_tokens,
            "miss_tokens": self.miss_tokens,
            "hit_rate": self.hit_tokens / looked_up if looked_up else 0.0,
            "evicted_tokens": self.evicted_tokens,
            "pinned_tokens": self.pinned_tokens,
        }

    def summary(self, top: int, visible: Callable[[Namespace], bool]) -> dict:
        """The tree for a person: see `cache.summary.summarize`."""
        return summarize(self, top, visible)

    def check_invariants(self) -> None:
        """Debug: recount everything from scratch; raise AssertionError on any mismatch."""
        check_radix_invariants(self)
