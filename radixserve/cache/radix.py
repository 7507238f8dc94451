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

The disk tier (``disk``, cache/disk.py; None: no disk tier): eviction then moves a node's
KV to disk instead of dropping it, and the node stays in the tree, on disk; the disk keeps
its own LRU order and drops whole disk leaves when full. A match stops at the first node on
disk; `match_disk` names the disk nodes that continue it, and a caller that wants them
locks the last (which keeps the whole path), allocates a block per page, asks
`load` for them and, once the worker has read them, calls `finish_load` (or, for an entry
that could not be read, `fail_load`, which drops it and what lies below it). An insert
that runs into a disk node takes the caller's blocks for it when it covers its whole
edge, and otherwise drops that disk subtree (its KV has just been computed again).

Eviction removes whole leaves, least recently used first (a logical clock orders accesses,
so runs are deterministic). A whole leaf may free more blocks than asked for; we accept
that rather than trimming leaves from the tail, because a trimmed node would silently
change what an outstanding handle to it means, while a removed node is detectably stale.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Sequence

from radixserve.cache.allocator import BlockAllocator
from radixserve.cache.disk import DiskTier
from radixserve.cache.invariants import check_radix_invariants
from radixserve.cache.node import (NOT_ON_DISK, ROOT_ID, DiskMatch, InsertResult, MatchResult,
                                   Namespace, RadixNode, TreeEvents)
from radixserve.cache.summary import summarize
from radixserve.cache.tree import RadixTree


class RadixCache(RadixTree):
    """Prefix cache of KV blocks; see the module docstring for the calling contract.

    ``enabled=False`` turns caching off without changing the caller's code path: matches
    are empty (at the root), inserts adopt nothing (the canonical blocks are the caller's),
    and lock/unlock of the root are no-ops. Such a tree stays empty, so it has no events.

    ``record_events=True``: keep what enters and leaves the tree for `take_events`, whose
    caller must then drain it (it grows until taken).

    ``disk``: the disk tier's books (see the module docstring), or None.
    """

    def __init__(self, allocator: BlockAllocator, page_size: int, enabled: bool = True,
                 record_events: bool = False, disk: DiskTier | None = None,
                 hash_key: bytes = b"") -> None:
        super().__init__(page_size, hash_key)
        self.allocator = allocator
        self.enabled = enabled
        self.record_events = record_events
        self.disk = disk if enabled else None
        self.disk_hit_tokens = 0
        """Tokens of requests' prefixes that came back from the disk tier."""
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
        while pos < n:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            # On disk (the walk went as far as memory does): take it back with the caller's
            # blocks where they cover its edge, else its KV was computed again: drop it.
            end = pos + len(child.tokens)
            if end > n or key[pos:end] != child.tokens:
                if child.lock_count:  # being loaded: it stays; the rest is not cached
                    return InsertResult(pos, canonical.tolist(), node)
                self._drop_subtree(child)
                break
            taken = array("q", blocks[pos // ps:end // ps])
            self.allocator.incref(taken)
            self._to_memory(child, taken)
            canonical.extend(taken)
            self._touch(child, self._clock)
            node, more = self._walk(key, n, mutate=True, out=canonical, start=child,
                                    offset=end)
            pos = more
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
            node.lock_count += 1
            if node.lock_count == 1:
                n = len(node.blocks)
                self.evictable_blocks -= n
                self.locked_blocks += n
                self._unfile(node)
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
                self._refile(node)
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

        Least recently used nodes go first, whole: to the disk tier when there is one (the
        node stays in the tree, on disk), else out of the tree. A parent left with no child
        in memory (and unlocked) joins the candidates; its access time is >= its children's,
        so it is considered no earlier than they were. May free more than asked, or fewer.
        """
        evictable, nodes = self._evictable, self._nodes
        freed: list[int] = []
        while len(freed) < num_blocks and evictable:
            node = nodes[evictable[0][1]]
            freed.extend(node.blocks)
            self.evicted_tokens += len(node.tokens)
            if node.is_namespace or not self._spill(node):
                self._drop_subtree(node)
        self.allocator.free(freed)
        return len(freed)

    def _spill(self, node: RadixNode) -> bool:
        """Move an evictable node's KV to the disk tier, making room there by dropping its
        LRU disk leaves; False (nothing done) when it cannot fit. Its blocks are the
        caller's to free: the tree no longer holds them."""
        disk = self.disk
        pages = len(node.blocks)
        if disk is None or not disk.fits(pages) or not self.make_disk_room(pages):
            return False
        self._unfile(node)
        node.disk_id = disk.store(node.blocks.tolist(), node.hashes[-1], self.page_size)
        node.blocks = array("q")
        self.evictable_blocks -= pages
        self.cached_tokens -= len(node.tokens)
        self.disk_tokens += len(node.tokens)
        parent = self._nodes[node.parent_id]
        parent.resident_children -= 1
        self._refile(parent)
        self._refile(node)
        return True

    def make_disk_room(self, pages: int) -> bool:
        """Drop least recently used disk leaves until an entry of ``pages`` more fits in the
        disk tier (0: until it is within its size again); False if it cannot."""
        disk, victims = self.disk, self._disk_evictable
        while disk.over(pages) > 0:
            if not victims:
                return False
            self._drop_subtree(self._nodes[victims[0][1]])
        return True

    def _drop_subtree(self, top: RadixNode) -> None:
        """Take ``top`` and everything below it out of the tree (all unlocked: a lock below
        would lock ``top``). Memory blocks are the caller's to free (only ``top`` can have
        any: whatever is below a node that may go is on disk); disk entries are dropped. A
        namespace node left empty goes too: it holds nothing."""
        nodes = self._nodes
        parent = nodes[top.parent_id]
        del parent.children[self._key_of(top)]
        if not top.on_disk and not top.is_namespace:
            parent.resident_children -= 1
        stack = [top]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            self._unfile(node)
            del nodes[node.id]
            if node.on_disk:
                self.disk.drop(node.disk_id)
                self.disk_tokens -= len(node.tokens)
            else:
                self.evictable_blocks -= len(node.blocks)
                self.cached_tokens -= len(node.tokens)
            if self.record_events:
                self._record_removed(node)
        if parent.is_namespace and not parent.children and not parent.lock_count:
            self._unfile(parent)
            del nodes[parent.id], self._root.children[parent.namespace]
        else:
            self._refile(parent)

    # ---------------------------------------------------------------- the disk tier

    def match_disk(self, node: RadixNode, tokens: Sequence[int], start: int,
                   max_len: int | None = None) -> DiskMatch:
        """The disk nodes that continue a match ending at ``node`` (``start`` tokens in)
        along ``tokens[:max_len]``, top down, the last one possibly matching only part of
        its edge (whole pages). Changes nothing."""
        limit = len(tokens) if max_len is None else min(max_len, len(tokens))
        limit -= limit % self.page_size
        if self.disk is None or start >= limit or not node.children:
            return DiskMatch([], 0)
        key = array("q", tokens[start:limit])
        found, pos = [], 0
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None or not child.on_disk:
                break
            found.append(child)
            m = self._match_len(child.tokens, key, pos, len(key))
            pos += m
            if m < len(child.tokens):
                break
            node = child
        return DiskMatch(found, pos)

    def load(self, match: DiskMatch, blocks: list[int]) -> None:
        """Ask for ``match``'s nodes to be read back into ``blocks`` (one per page, in
        order; the caller's allocation). The caller has locked ``match.nodes[-1]``."""
        i = 0
        for node in match.nodes:
            pages = len(node.hashes)
            self.disk.load(node.disk_id, node.hashes[-1], blocks[i:i + pages])
            i += pages

    def finish_load(self, node: RadixNode, blocks: list[int]) -> bool:
        """``node``'s KV is in ``blocks`` now: it is in memory again, and the tree takes the
        caller's references to them. False (the caller keeps its blocks) when an insert
        brought it back to memory first."""
        self._check_live(node)
        if not node.on_disk:
            return False
        self._to_memory(node, array("q", blocks))
        self.disk.counters["disk_loads"] += 1
        self.disk.counters["disk_loaded_tokens"] += len(node.tokens)
        return True

    def fail_load(self, node: RadixNode) -> None:
        """``node``'s entry could not be read: it and its subtree leave the tree (they are
        misses from now on). Call after unlocking the load, while ``node`` is unlocked."""
        if self._nodes.get(node.id) is node and node.on_disk:
            self.disk.counters["disk_load_failures"] += 1
            self._drop_subtree(node)

    def restore_disk_node(self, parent: RadixNode, tokens: array[int], entry: int,
                          last_access: int) -> RadixNode:
        """A node on disk below ``parent`` (a namespace's start or a disk node), for a tree
        resumed from its saved index (cache/persist.py): its KV is the disk entry
        ``entry``, already written."""
        node = self._add_leaf(parent, tokens, array("q"))
        parent.resident_children -= 1  # _add_leaf counted a child in memory
        self._unfile(node)
        node.disk_id, node.last_access = entry, last_access
        self.cached_tokens -= len(tokens)
        self.disk_tokens += len(tokens)
        self.disk.adopt(entry, len(node.hashes))
        self._refile(node)
        self._refile(parent)
        return node

    def _to_memory(self, node: RadixNode, blocks: array[int]) -> None:
        """A disk node's KV is in ``blocks`` (the tree's references): back to memory."""
        self._unfile(node)
        self.disk.drop(node.disk_id)
        node.disk_id, node.blocks = NOT_ON_DISK, blocks
        n = len(blocks)
        if node.lock_count:
            self.locked_blocks += n
        else:
            self.evictable_blocks += n
        self.cached_tokens += len(node.tokens)
        self.disk_tokens -= len(node.tokens)
        parent = self._nodes[node.parent_id]
        parent.resident_children += 1
        self._refile(parent)
        self._refile(node)

    def flush(self) -> None:
        """Free every block in the tree and drop every disk entry that no pin holds; raises
        if a running request holds a lock. Pinned prefixes stay (a pin is a promise to keep
        them: unpin to drop them); without pins the tree is emptied and reports `cleared`,
        with pins every other node is dropped and reported removed."""
        roots = self._root.children.values()
        if any(c.lock_count > c.pin_count for c in roots):
            raise RuntimeError("flush with locked nodes (requests still running)")
        if any(c.pin_count for c in roots):
            freed: list[int] = []
            for order in (self._evictable, self._disk_evictable):
                while order:
                    node = self._nodes[order[0][1]]
                    freed.extend(node.blocks)
                    self._drop_subtree(node)
            self.allocator.free(freed)
            return
        blocks = self.all_blocks()
        if self.disk is not None:
            for node in self._nodes.values():
                if node.on_disk:
                    self.disk.drop(node.disk_id)
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
            "disk_tokens": self.disk_tokens,
            "disk_hit_tokens": self.disk_hit_tokens,
            **(self.disk.stats() if self.disk is not None else {}),
        }

    def summary(self, top: int, visible: Callable[[Namespace], bool]) -> dict:
        """The tree for a person: see `cache.summary.summarize`."""
        return summarize(self, top, visible)

    def check_invariants(self) -> None:
        """Debug: recount everything from scratch; raise AssertionError on any mismatch."""
        check_radix_invariants(self)
