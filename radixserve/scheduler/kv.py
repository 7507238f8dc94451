"""Block bookkeeping for sequences: what they take from the tree and the allocator, and
give back.

Ownership is by reference count: every holder of a block owns one reference, the tree
for each block in it and each sequence for each entry of its `block_table`, so a block is
free exactly when nobody holds it (`check_invariants` recounts that from the holders).
A table's first `tree_len / page_size` blocks are the tree's too, on the path the
sequence keeps locked; the rest are the sequence's, possibly shared with its forks.

Copy-on-write: forks (parallel samples, beams) share every block by reference. Before a
fork is taken, the parent's whole pages go into the tree, so the only block siblings
share outside it is the partially filled last one; whoever first writes to a shared
block gets a copy (`block_copies`, done by the worker before the step's writes) instead.

The tree holds whole pages only. A finished sequence's partly filled last block is kept
too, in `partials` (one reference each, reclaimed first under memory pressure): a later
request whose tokens continue the same way, such as each branch of a DSL fork after its
shared prefix was committed, gets a copy of it instead of recomputing up to a page.
These methods are the only places that move blocks, so the invariant is kept here.

The disk tier: a waiting sequence whose cached prefix goes on into nodes on disk (and
for which reading them beats recomputing, as the worker measured at start-up) gets blocks
for them and waits, holding no blocks of its own, while the next step reads them in
(`start_load`, `finish_loads`); it is then admitted like any other, its prefix in memory.
Until it is admitted, the loaded prefix stays locked for it (its "hold"), so the growth of
running requests and other admissions cannot send it straight back to disk; a scheduler
that runs out of memory for its running requests drops the holds (`drop_holds`) before it
retracts any of them.

Namespaces (tenants, cache_salt): each sequence matches, inserts and keeps partial blocks
in its request's namespace only, so it shares blocks with another sequence only inside one
namespace (forks and beams are of one request). Tree attention (worker/cascade.py) groups
sequences by equal block ids, so it can never group two namespaces either.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from radixserve.cache.allocator import BlockAllocator
from radixserve.cache.node import DiskMatch, RadixNode
from radixserve.cache.radix import RadixCache
from radixserve.scheduler.request import Req


@dataclass(eq=False)
class PrefixLoad:
    """A waiting sequence's prefix on its way back from the disk tier: `match`'s nodes, to
    be read into `blocks` (one per page, in order) by the step that carries it. The last
    node is locked (so the whole path is) until `KVManager.finish_loads`."""

    req: Req
    match: DiskMatch
    entries: list[int]
    """Each node's disk entry when the load was asked for, as the worker reports them."""
    blocks: list[int]
    hold: RadixNode | None = None
    """Once loaded: the deepest node that came back, locked for `req` until it is admitted
    (see the module docstring)."""

    @property
    def pending(self) -> bool:
        """Asked for, and the step that reads it has not run yet."""
        return self.req.loading is self and self.hold is None


class KVManager:
    def __init__(self, allocator: BlockAllocator, tree: RadixCache, page_size: int,
                 load_cost: float = 0.0, prefill_cost: float = 0.0) -> None:
        """`load_cost`, `prefill_cost`: seconds per token to read KV back from the disk
        tier and to compute it (the worker's start-up measurements)."""
        self.allocator, self.tree, self.page_size = allocator, tree, page_size
        self.load_cost, self.prefill_cost = load_cost, prefill_cost
        self.loads: list[PrefixLoad] = []
        """Loads asked for since the last `take_loads`: the next step carries them."""
        self.held: list[PrefixLoad] = []
        """Loads done whose prefixes are held for their sequences (`drop_holds` ends it)."""
        self.copies: list[tuple[int, int]] = []
        """Copy-on-write copies the step being planned needs; taken by `take_copies`."""
        self.copied_blocks = 0
        self.partials: OrderedDict[tuple[str | None, int, tuple[int, ...]], int] = OrderedDict()
        """Part-filled last blocks of finished sequences, by (their cache namespace, id of
        the tree node their page starts after, the tokens they hold), least recently used
        first. The namespace is in the key because a prefix shorter than a page ends at
        the root, which every namespace shares: without it one tenant's first partial page
        would be another's hit."""
        self.max_partials = max(1, allocator.num_blocks // 16)
        self.partial_tokens = 0
        """Tokens that admissions took from `partials` instead of computing them."""

    @property
    def evictable_blocks(self) -> int:
        """Cached blocks nobody else holds: the tree's unlocked ones and `partials`."""
        return self.tree.evictable_blocks + len(self.partials)

    @property
    def available_blocks(self) -> int:
        """Blocks an allocation can get: free ones plus what eviction can reclaim."""
        return self.allocator.num_free + self.evictable_blocks

    def _reclaim(self, n: int) -> None:
        """Free at least `n` blocks if that many are evictable: partial blocks first (each
        saves less than a page of compute), then the tree's LRU leaves."""
        while n > 0 and self.partials:
            self.allocator.free([self.partials.popitem(last=False)[1]])
            n -= 1
        if n > 0:
            self.tree.evict(n)

    def blocks_for(self, reqs: list[Req], n: int) -> int:
        """New blocks needed to give each of `reqs` room for `n` more tokens (copies of
        shared last blocks included)."""
        return sum(self._new_pages(r, n) + self._shared_tail(r) for r in reqs)

    def _new_pages(self, req: Req, n: int) -> int:
        return max(0, -(-(req.kv_len + n) // self.page_size) - len(req.block_table))

    def _shared_tail(self, req: Req) -> bool:
        """Whether the next write lands in a block someone else also holds."""
        i = req.kv_len // self.page_size
        return i < len(req.block_table) and self.allocator.refcount(req.block_table[i]) > 1

    def attach_prefix(self, req: Req) -> None:
        """Point a waiting sequence at its longest cached prefix, locked against eviction."""
        match = self.tree.match_prefix(req.tokens(0, req.seq_len), req.prefix_limit,
                                       namespace=req.namespace)
        self.tree.lock(match.node)
        self.allocator.incref(match.blocks)
        req.block_table = list(match.blocks)
        req.kv_len = req.tree_len = match.length
        req.node = match.node
        if self.partials:
            self._copy_partial(req)

    def _copy_partial(self, req: Req) -> None:
        """Extend `req`'s match into the next page with a copy of a kept partial block that
        holds the tokens that follow (the longest such), if a block is free for it."""
        most = min(self.page_size - 1, req.prefix_limit - req.kv_len)
        if most <= 0 or not self.allocator.num_free:
            return
        tokens = tuple(req.tokens(req.kv_len, req.kv_len + most))
        for n in range(most, 0, -1):
            key = (req.namespace, req.node.id, tokens[:n])
            src = self.partials.get(key)
            if src is not None:
                self.partials.move_to_end(key)
                (dst,) = self.allocator.alloc(1)
                self.copies.append((src, dst))
                req.block_table.append(dst)
                req.kv_len += n
                self.partial_tokens += n
                return

    def _keep_partial(self, req: Req) -> None:
        """Keep `req`'s part-filled last block (after `cache_progress`, which put the whole
        pages in the tree) for a request that continues the same tokens."""
        start, end = req.tree_len, req.kv_len
        if not self.tree.enabled or not 0 < end - start < self.page_size:
            return
        key = (req.namespace, req.node.id, tuple(req.tokens(start, end)))
        if key in self.partials:
            self.partials.move_to_end(key)
            return
        block = req.block_table[start // self.page_size]
        if self.allocator.refcount(block) > 1:
            return  # a fork still writes to it; and reclaiming it must free a block
        self.allocator.incref([block])
        self.partials[key] = block
        if len(self.partials) > self.max_partials:
            self._reclaim(1)

    def grow(self, req: Req, n: int) -> int:
        """Make room for up to `n` more tokens of `req`, evicting cached prefixes if the free
        list is short and copying a shared last block; returns how many tokens fit (0 if not
        even one)."""
        page = self.page_size
        copy = self._shared_tail(req)
        pages = self._new_pages(req, n)
        short = pages + copy - self.allocator.num_free
        if short > 0:
            self._reclaim(short)
        free = self.allocator.num_free - copy
        if free < 0:
            return 0
        if pages > free:
            n = min(n, (len(req.block_table) + free) * page - req.kv_len)
            if n <= 0:
                return 0
            pages = self._new_pages(req, n)
        if copy:
            i = req.kv_len // page
            src, (dst,) = req.block_table[i], self.allocator.alloc(1)
            self.copies.append((src, dst))
            self.allocator.free([src])  # others still hold it: it stays allocated
            req.block_table[i] = dst
            self.copied_blocks += 1
        if pages:
            req.block_table.extend(self.allocator.alloc(pages))
        return n

    def start_load(self, req: Req, room: int | None = None) -> bool:
        """After `attach_prefix`: if the disk tier holds more of `req`'s prefix and reading
        it is cheaper than computing it, let go of `req`'s blocks and ask the next step to
        load the rest (or, when another sequence's load already brings it, just wait).
        True when `req` now waits for a load. `room`: the most tokens of KV `req` may add
        now (None: no limit); a load that would leave it no room to run is not started,
        since what it brings back would be evicted again before `req` could use it."""
        tree = self.tree
        if tree.disk is None:
            return False
        match = tree.match_disk(req.node, req.tokens(0, req.seq_len), req.kv_len,
                                req.prefix_limit)
        if not match.nodes:
            return False
        if match.nodes[0].lock_count:  # being loaded already (only loads lock disk nodes)
            self.release(req, cache=False)
            return True
        gain = match.length * self.prefill_cost
        if match.pages * self.page_size * self.load_cost >= gain:
            return False
        grows_by = match.pages * self.page_size + req.to_compute - match.length
        if room is not None and grows_by > room:
            return False
        tree.lock(match.nodes[-1])
        short = match.pages - self.allocator.num_free
        if short > 0:
            self._reclaim(short)
        blocks = self.allocator.alloc(match.pages)
        if blocks is None:
            tree.unlock(match.nodes[-1])
            return False
        tree.load(match, blocks)
        self.release(req, cache=False)  # its prefix in memory stays locked by the load
        req.loading = PrefixLoad(req, match, [n.disk_id for n in match.nodes], blocks)
        self.loads.append(req.loading)
        return True

    def take_loads(self) -> list[PrefixLoad]:
        loads, self.loads = self.loads, []
        return loads

    def finish_loads(self, loads: list[PrefixLoad], failed: Iterable[int] | None) -> None:
        """The step that carried `loads` ran: their nodes are in memory again, held for
        their sequences, but for the entries in `failed` (dropped from the tree with what
        lies below them: misses from now on). `failed` None: the step never ran, so nothing
        was read (the nodes stay on disk)."""
        bad = None if failed is None else set(failed)
        tree = self.tree
        for load in loads:
            tree.unlock(load.match.nodes[-1])
            ok, start, loaded, hold = bad is not None, 0, 0, None
            for node, entry in zip(load.match.nodes, load.entries):
                pages = len(node.hashes)
                blocks = load.blocks[start:start + pages]
                start += pages
                if ok and entry in bad:
                    tree.fail_load(node)
                    ok = False
                if ok:
                    if tree.finish_load(node, blocks):
                        loaded += len(node.tokens)
                    else:
                        self.allocator.free(blocks)
                    hold = node
                else:
                    self.allocator.free(blocks)
            req = load.req
            req.disk_tokens = max(req.disk_tokens, min(loaded, load.match.length))
            if hold is not None and req.loading is load:
                tree.lock(hold)
                load.hold = hold
                self.held.append(load)
            elif req.loading is load:
                req.loading = None

    def drop_hold(self, req: Req) -> None:
        """End `req`'s hold on its loaded prefix, if it has one (see the module docstring)."""
        load = req.loading
        if load is not None and load.hold is not None:
            self.tree.unlock(load.hold)
            req.loading = None
            self.held.remove(load)

    def drop_holds(self) -> None:
        """End every hold (memory is short for the running requests)."""
        for load in list(self.held):
            self.drop_hold(load.req)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    def fork(self, parent: Req, child: Req) -> None:
        """Let `child` share all of `parent`'s KV by reference. The parent's whole pages go
        into the tree first, so the siblings share nothing outside it but the last block."""
        self.cache_progress(parent)
        self.tree.lock(parent.node)
        self.allocator.incref(parent.block_table)
        child.block_table = list(parent.block_table)
        child.kv_len, child.tree_len, child.node = parent.kv_len, parent.tree_len, parent.node

    def cache_progress(self, req: Req) -> None:
        """Insert the whole pages of `req`'s computed KV into the tree and move its lock
        there, so other sequences can share them while it keeps running. Where another
        sequence inserted the same tokens first, switch to the tree's blocks in one pass."""
        if not self.tree.enabled:
            return
        page = self.page_size
        aligned = req.kv_len // page * page
        if aligned <= req.tree_len:
            return
        inserted = self.tree.insert(req.tokens(0, aligned), req.block_table[:aligned // page],
                                    namespace=req.namespace)
        aligned = len(inserted.blocks) * page  # short of it only past a node being loaded
        table = req.block_table
        for i in range(req.tree_len // page, aligned // page):
            canonical = inserted.blocks[i]
            if table[i] != canonical:
                self.allocator.incref([canonical])
                self.allocator.free([table[i]])
                table[i] = canonical
        self.tree.lock(inserted.node)
        self.tree.unlock(req.node)
        req.node, req.tree_len = inserted.node, aligned

    def release(self, req: Req, cache: bool) -> None:
        """Drop all of `req`'s KV: cache its computed pages first if `cache`, unlock its
        prefix, drop its references. The sequence can be attached again later."""
        self.drop_hold(req)
        if req.node is None:
            return
        if cache:
            self.cache_progress(req)
            self._keep_partial(req)
        if self.copies:  # planned this step into blocks of `req` that are about to go
            mine = set(req.block_table)
            self.copies = [c for c in self.copies if c[1] not in mine]
        self.tree.unlock(req.node)
        self.allocator.free(req.block_table)
        req.block_table, req.kv_len, req.tree_len, req.node = [], 0, 0, None

    def flush(self) -> None:
        """Drop every cached prefix and kept partial block (nothing may be running)."""
        self.tree.flush()
        self.flush_partials()

    def flush_partials(self) -> None:
        self.allocator.free(self.partials.values())
        self.partials.clear()

    def check_invariants(self, holding: Iterable[Req]) -> None:
        """Every block's count equals its holders (the tree, each sequence in `holding`);
        the free list is exactly the blocks nobody holds; a sequence holds tree blocks
        only on the path it keeps locked. Raises AssertionError otherwise."""
        self.tree.check_invariants()
        holding = list(holding)
        tree_blocks = self.tree.all_blocks()
        assert self.tree.evictable_blocks + self.tree.locked_blocks == len(tree_blocks)
        self.allocator.check_holders([tree_blocks, list(self.partials.values()),
                                      *(r.block_table for r in holding)])
        assert all(self.allocator.refcount(b) == 1 for b in self.partials.values()), \
            "a kept partial block has another holder: reclaiming it would free nothing"
        in_tree = set(tree_blocks)
        page = self.page_size
        for req in holding:
            table = req.block_table
            assert set(table[:req.tree_len // page]) <= in_tree, \
                f"{req.name} uses blocks the tree no longer holds"
            outside = in_tree.intersection(table[req.tree_len // page:])
            assert not outside, \
                f"{req.name} holds tree blocks {sorted(outside)} off its locked path"
