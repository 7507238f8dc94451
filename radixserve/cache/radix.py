"""RadixCache: one global radix tree over token ids, mapping cached prefixes to KV blocks.

How a scheduler uses it (the lock/match/insert/evict contract; each method's docstring has
its part):

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

The cache is composed of: the tree (cache/tree.py: structure, locks, LRU orders, counters),
the disk tier's mover (cache/tiering.py), the event log (cache/events.py) and the token
index's feed (cache/token_index.py), each but the tree with a stand-in doing nothing. What it
adds itself: the allocator's references, pins, statistics and the public contract.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Sequence

from radixserve.cache.allocator import BlockAllocator
from radixserve.cache.disk import DiskTier
from radixserve.cache.events import EventLog, NoEventLog, TreeEvents
from radixserve.cache.invariants import check_radix_invariants
from radixserve.cache.node import DiskMatch, InsertResult, MatchResult, Namespace, RadixNode
from radixserve.cache.summary import summarize
from radixserve.cache.tiering import MemoryOnly, Tiering
from radixserve.cache.token_index import IndexFeed, NoIndexFeed, TokenIndex
from radixserve.cache.tree import RadixTree


class RadixCache:
    """Prefix cache of KV blocks; see the module docstring for the calling contract.

    ``enabled=False`` turns caching off without changing the caller's code path: matches
    are empty (at the root), inserts adopt nothing (the canonical blocks are the caller's),
    and lock/unlock of the root are no-ops. Such a tree stays empty: no events, no index.

    ``record_events``: True keeps what enters and leaves the tree for `take_events`, whose
    caller must then drain it (opt-in: nothing else drains it, and it grows until taken);
    a callable makes that log from the tree (a BlockEventLog, cache/block_events.py).

    ``disk``: the disk tier's books (cache/disk.py; see cache/tiering.py for how nodes move
    there and back), or None: no disk tier. ``hash_key`` keys the page hashes (the cache
    secret; see cache/events.py).
    """

    def __init__(self, allocator: BlockAllocator, page_size: int, enabled: bool = True,
                 record_events: bool | Callable[[RadixTree], EventLog] = False,
                 disk: DiskTier | None = None, hash_key: bytes = b"",
                 token_index: TokenIndex | None = None) -> None:
        self.tree = RadixTree(page_size, hash_key)
        # Locks are the tree's own (its counters and eviction orders follow them): the
        # cache hands them out as they are, with no call of its own in between.
        self.lock: Callable[[RadixNode], None] = self.tree.lock
        """Protect the prefix ending at ``node`` (node and ancestors) from eviction until
        the matching `unlock` (the caller owes one per lock; the root's are no-ops). Raises
        ValueError for a stale handle. Namespace-blind: a namespace node is locked like any
        node on the path."""
        self.unlock: Callable[[RadixNode], None] = self.tree.unlock
        """Undo one `lock(node)`; raises RuntimeError if ``node`` is not locked."""
        self.allocator = allocator
        self.enabled = enabled
        self.disk = disk if enabled else None
        """The disk tier's books, or None (a disabled cache has none)."""
        self.events = (record_events(self.tree) if callable(record_events)
                       else EventLog() if record_events else NoEventLog())
        self.take_events: Callable[[], TreeEvents] = self.events.take
        """What entered and left the tree since the previous call (see `TreeEvents` and
        `EventLog.take`), forgotten here. Raises RuntimeError unless the cache records events."""
        self.tiers = (MemoryOnly() if self.disk is None
                      else Tiering(self.tree, self.disk, self.events))
        self.index = NoIndexFeed() if token_index is None else IndexFeed(self.tree, token_index)
        self.disk_hit_tokens = 0
        """Tokens of requests' prefixes that came back from the disk tier."""
        self.hit_tokens = 0
        self.miss_tokens = 0
        self.evicted_tokens = 0
        self.pinned_tokens = 0
        """Tokens on nodes held by at least one pin (each counted once)."""

    # ---------------------------------------------------------------- the tree's counters
    # Read-only views of the tree's (cache/tree.py has what each counts).

    page_size = property(lambda self: self.tree.page_size)
    root = property(lambda self: self.tree.root)
    num_nodes = property(lambda self: self.tree.num_nodes)
    evictable_blocks = property(lambda self: self.tree.evictable_blocks)
    locked_blocks = property(lambda self: self.tree.locked_blocks)
    cached_tokens = property(lambda self: self.tree.cached_tokens)
    disk_tokens = property(lambda self: self.tree.disk_tokens)

    def nodes(self) -> Iterator[RadixNode]:
        """Every node of the tree, the root first (see `RadixTree.nodes`)."""
        return self.tree.nodes()

    def all_blocks(self) -> list[int]:
        """Every block id the tree holds in memory (each once): evictable plus locked."""
        return self.tree.all_blocks()

    def page_hashes_in_tree(self) -> list[int]:
        """The page hash of every page in the tree (see `RadixTree.page_hashes_in_tree`)."""
        return self.tree.page_hashes_in_tree()

    # ---------------------------------------------------------------- lookup / insert

    def match_prefix(self, tokens: Sequence[int], max_len: int | None = None, *,
                     peek: bool = False, namespace: Namespace = None) -> MatchResult:
        """Longest cached prefix of ``tokens[:max_len]`` in ``namespace``, rounded down to
        whole pages (a namespace nothing was inserted in matches nothing, at the root).

        Namespaces (None, the default, or an opaque string; the server derives it from the
        caller's tenant and ``cache_salt``) are part of the key from the root (node.py): a
        match in one never sees, splits or refreshes another's prefixes.

        The caller chooses ``max_len`` (e.g. ``len(tokens) - 1`` so at least one token is
        computed for logits); the cache only rounds down. A non-peek match splits the edge
        where the match ends (so ``node`` ends exactly at ``length``) and refreshes the LRU
        time of the path. ``peek=True`` changes nothing: for policies that only want the
        length (its ``node`` must not be locked). A match stops at the first node on disk
        (see `match_disk`).

        Afterwards the caller owns nothing: the blocks are the tree's until it locks
        ``node`` (before anything may call `evict`) and takes its own reference to each.
        """
        tree = self.tree
        limit = len(tokens) if max_len is None else max(0, min(max_len, len(tokens)))
        if not self.enabled:
            return MatchResult([], tree.root, 0)
        start = tree.namespace_node(namespace, create=False)
        if start is None:
            return MatchResult([], tree.root, 0)
        key = array("q", tokens[:limit])
        if not peek:
            tree.tick()
        out = array("q")
        node, length = tree.walk(key, limit, mutate=not peek, out=out, start=start)
        return MatchResult(out.tolist(), node, length)

    def record_lookup(self, node: RadixNode, hit: int, looked_up: int,
                      disk_hit: int = 0) -> None:
        """Count one request's lookup for `stats()`: `hit` of its `looked_up` tokens were
        cached (`disk_hit` of them loaded back from the disk tier), the prefix ending at
        ``node``, every node of whose path gets a hit (for `summary`). The caller counts
        each request once (a match is repeated whenever an admission has to be retried, so
        matches themselves are not counted)."""
        self.hit_tokens += hit
        self.miss_tokens += looked_up - hit
        self.disk_hit_tokens += disk_hit
        for n in self.tree.path(node):
            n.hits += 1

    def insert(self, tokens: Sequence[int], blocks: Sequence[int], *,
               namespace: Namespace = None) -> InsertResult:
        """Add ``tokens`` (whole pages) whose KV lives in ``blocks`` (one per page) to
        ``namespace`` (made on its first insert; the same tokens in two namespaces are two
        copies with their own blocks).

        The already-cached part is not re-added; ``result.blocks`` names the canonical
        block of every page. The tree takes its own reference to each block it adopts; the
        caller's references are untouched: where ``result.blocks`` differ from the caller's,
        the caller's are duplicates to drop. Refreshes the path's LRU. An insert that runs
        into a disk node takes the caller's blocks for it when they cover its whole edge,
        and otherwise drops that disk subtree (its KV has just been computed again).
        """
        n, ps, tree = len(tokens), self.page_size, self.tree
        if n % ps:
            raise ValueError(f"insert of {n} tokens: not a multiple of page_size {ps}")
        if len(blocks) != n // ps:
            raise ValueError(f"insert of {n} tokens needs {n // ps} blocks, got {len(blocks)}")
        if not self.enabled:
            return InsertResult(n, list(blocks), tree.root)
        if n == 0:
            tree.namespace_node(namespace, create=False)  # still checks the namespace
            return InsertResult(0, [], tree.root)
        key = array("q", tokens)
        tree.tick()
        canonical = array("q")
        start = tree.namespace_node(namespace, create=True)
        node, pos = tree.walk(key, n, mutate=True, out=canonical, start=start)
        # The walk went as far as memory does; what stops it further down is on disk.
        while pos < n:
            child = tree.next_child(node, key, pos)
            if child is None:
                break
            end = pos + len(child.tokens)
            if end > n or key[pos:end] != child.tokens:  # its KV was computed again
                if child.lock_count:  # being loaded: it stays; the rest is not cached
                    return InsertResult(pos, canonical.tolist(), node)
                self._remove(child)  # which drops a namespace node it empties: make it again
                node = node if tree.is_live(node) else tree.namespace_node(namespace, True)
                break
            taken = array("q", blocks[pos // ps:end // ps])
            self.allocator.incref(taken)
            self.tiers.reclaim(child, taken)
            canonical.extend(taken)
            node, pos = tree.walk(key, n, mutate=True, out=canonical, start=child,
                                  offset=end)  # which touches child too
        if pos < n:
            adopted = array("q", blocks[pos // ps:])
            self.allocator.incref(adopted)
            node = self.index.added(tree.add_leaf(node, key[pos:], adopted))
            canonical.extend(adopted)
            self.events.stored(node)
        return InsertResult(pos, canonical.tolist(), node)

    # ---------------------------------------------------------------- locks and pins

    def pin(self, node: RadixNode) -> None:
        """Keep the prefix ending at ``node`` cached until the matching `unpin`: a lock that
        no request owns (so eviction skips it), also counted as a pin along the path
        (``pin_count``, part of each node's ``lock_count``), so `pinned_tokens` and `flush`
        can tell pins from the locks of running requests. What a pin is for (its tokens,
        its expiry) is the caller's (scheduler/pins.py); the cache only holds it."""
        if node.is_root:
            raise ValueError("pin of the root: an empty prefix")
        self.tree.lock(node)
        for n in self.tree.path(node):
            if n.pin_count == 0:
                self.pinned_tokens += len(n.tokens)
            n.pin_count += 1

    def unpin(self, node: RadixNode) -> None:
        """Undo one `pin(node)`; raises if ``node`` is not pinned."""
        self.tree.check_live(node)
        if node.pin_count <= 0:
            raise RuntimeError(f"unpin of unpinned node {node!r}")
        for n in self.tree.path(node):
            n.pin_count -= 1
            if n.pin_count == 0:
                self.pinned_tokens -= len(n.tokens)
        self.tree.unlock(node)

    def unpinned_tokens(self, node: RadixNode) -> int:
        """Tokens of the prefix ending at ``node`` that no pin holds yet: what pinning it
        would add to `pinned_tokens`."""
        return sum(len(n.tokens) for n in self.tree.path(node) if n.pin_count == 0)

    # ---------------------------------------------------------------- eviction

    def evict(self, num_blocks: int) -> int:
        """Free at least ``num_blocks`` blocks if that many are evictable; return freed.

        Whole nodes go, least recently used first (a logical clock orders accesses, so runs
        are deterministic), in one LRU order over all namespaces (the pool is shared): to
        the disk tier when there is one and it has room (the node stays in the tree, on
        disk), else out of the tree. A parent left with no child in memory (and unlocked)
        joins the candidates; its access time is >= its children's, so it is considered no
        earlier than they were. The freed blocks go back to the allocator (they were the
        tree's alone), and handles to nodes that left the tree are stale from now on.

        May free more than asked (a whole node), or fewer. We accept that rather than
        trimming nodes from the tail, because a trimmed node would silently change what an
        outstanding handle to it means, while a removed one is detectably stale.
        """
        tree = self.tree
        freed: list[int] = []
        while len(freed) < num_blocks:
            node = tree.oldest_in_memory()
            if node is None:
                break
            freed.extend(node.blocks)
            self.evicted_tokens += len(node.tokens)
            if node.is_namespace or not self._spill(node):
                self._remove(node)
        self.allocator.free(freed)
        return len(freed)

    def _spill(self, node: RadixNode) -> bool:
        """Move an evictable node's KV to the disk tier, making room there; False (nothing
        done) when it cannot fit or there is no disk tier. Its blocks are the caller's to
        free: the tree no longer holds them."""
        pages = len(node.blocks)
        if not self.tiers.fits(pages) or not self.make_disk_room(pages):
            return False
        self.tiers.spill(node)
        return True

    def make_disk_room(self, pages: int) -> bool:
        """Drop least recently used disk leaves until an entry of ``pages`` more fits in the
        disk tier (0: until it is within its size again); False if it cannot."""
        while self.tiers.over(pages) > 0:
            victim = self.tree.oldest_on_disk()
            if victim is None:
                return False
            self._remove(victim)
        return True

    def _remove(self, top: RadixNode) -> None:
        """Take ``top`` and its subtree out of the tree (see `RadixTree.detach`): their disk
        entries are dropped and their pages reported removed; ``top``'s memory blocks are
        the caller's to free."""
        self.index.removing(top)  # while its path is still there
        removed = self.tree.detach(top)
        self.tiers.forget(removed)
        self.events.removed(removed)

    # ---------------------------------------------------------------- the disk tier

    def match_disk(self, node: RadixNode, tokens: Sequence[int], start: int,
                   max_len: int | None = None) -> DiskMatch:
        """The disk nodes that continue a match ending at ``node`` (``start`` tokens in)
        along ``tokens[:max_len]``, top down, the last one possibly matching only part of
        its edge (whole pages). Changes nothing. A caller that wants them locks the last
        (which keeps the whole path), allocates a block per page and calls `load`."""
        return self.tiers.match(node, tokens, start, max_len)

    def load(self, match: DiskMatch, blocks: list[int]) -> None:
        """Ask for ``match``'s nodes to be read back into ``blocks`` (one per page, in
        order; the caller's allocation). The caller has locked ``match.nodes[-1]``; once
        the worker has read them it calls `finish_load` (or `fail_load`) for each."""
        self.tiers.load(match, blocks)

    def finish_load(self, node: RadixNode, blocks: list[int]) -> bool:
        """``node``'s KV is in ``blocks`` now: it is in memory again, and the tree takes the
        caller's references to them. False (the caller keeps its blocks) when an insert
        brought it back to memory first."""
        return self.tiers.finish_load(node, blocks)

    def fail_load(self, node: RadixNode) -> None:
        """``node``'s entry could not be read: it and its subtree leave the tree (they are
        misses from now on). Call after unlocking the load, while ``node`` is unlocked."""
        if self.tree.is_live(node) and node.on_disk:
            self.tiers.load_failed()
            self._remove(node)

    def restore_disk_node(self, parent: RadixNode, tokens: array[int], entry: int,
                          last_access: int) -> RadixNode:
        """A node on disk below ``parent`` (a namespace's start or a disk node), for a tree
        resumed from its saved index (cache/persist.py): its KV is the disk entry
        ``entry``, already written."""
        return self.index.added(self.tiers.restore(parent, tokens, entry, last_access))

    # ---------------------------------------------------------------- flush

    def flush(self) -> None:
        """Free every block in the tree and drop every disk entry that no pin holds; raises
        if a running request holds a lock. Pinned prefixes stay (a pin is a promise to keep
        them: unpin to drop them); without pins the tree is emptied and reports `cleared`,
        with pins every other node is dropped and reported removed. Namespace-blind."""
        tree = self.tree
        roots = tree.root.children.values()
        if any(c.lock_count > c.pin_count for c in roots):
            raise RuntimeError("flush with locked nodes (requests still running)")
        if any(c.pin_count for c in roots):
            freed: list[int] = []
            for oldest in (tree.oldest_in_memory, tree.oldest_on_disk):
                while (node := oldest()) is not None:
                    freed.extend(node.blocks)
                    self._remove(node)
            self.allocator.free(freed)
            return
        blocks = tree.all_blocks()
        self.tiers.forget(tree.nodes())
        tree.reset()
        self.allocator.free(blocks)
        if self.enabled:
            self.events.cleared()
            self.index.cleared()

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
            **self.tiers.stats(),
        }

    def summary(self, top: int, visible: Callable[[Namespace], bool]) -> dict:
        """The tree for a person: see `cache.summary.summarize`."""
        return summarize(self.tree, top, visible)

    def check_invariants(self) -> None:
        """Debug: recount everything from scratch; raise AssertionError on any mismatch."""
        check_radix_invariants(self.tree, self.allocator, self.disk, self.pinned_tokens)
