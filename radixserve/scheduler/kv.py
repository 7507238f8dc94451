"""Block bookkeeping for sequences: what they take from the tree and the allocator, and
give back.

Every method works on a sequence's `KVHandle` (scheduler/kv_handle.py), whose docstring
states the ownership rule: by reference count, one reference per holder, the tree for each
block in it and each handle for each entry of its `block_table`, so a block is free exactly
when nobody holds it (`check_invariants` recounts that from the holders). What the manager
reads of a sequence besides its handle is its tokens, passed in.

Copy-on-write: forks (parallel samples, beams) share every block by reference. Before a
fork is taken, the parent's whole pages go into the tree, so the only block siblings
share outside it is the partially filled last one; whoever first writes to a shared
block gets a copy (`block_copies`, done by the worker before the step's writes) instead.

The tree holds whole pages only. A finished sequence's partly filled last block is kept
too, in `partials` (one reference each, reclaimed first under memory pressure): a later
request whose tokens continue the same way, such as each branch of a DSL fork after its
shared prefix was committed, gets a copy of it instead of recomputing up to a page.
These methods are the only places that move blocks, so the invariant is kept here.

The disk tier: a waiting sequence whose cached prefix goes on into nodes on disk may wait
for them to be read back instead of recomputing them (`start_load`); the loads in flight
and the holds on what came back are `DiskLoads`' (scheduler/disk_loads.py).

Namespaces (tenants, cache_salt): each sequence matches, inserts and keeps partial blocks
in its request's namespace only, so it shares blocks with another sequence only inside one
namespace (forks and beams are of one request). Tree attention (worker/cascade.py) groups
sequences by equal block ids, so it can never group two namespaces either.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from radixserve.cache.allocator import BlockAllocator
from radixserve.cache.radix import RadixCache
from radixserve.scheduler.disk_loads import DiskLoads
from radixserve.scheduler.kv_handle import KVHandle, PrefixLoad, TokenReader


class KVManager:
    """Moves blocks between the allocator, the tree and the sequences' handles."""

    def __init__(self, allocator: BlockAllocator, tree: RadixCache, page_size: int,
                 load_cost: float = 0.0, prefill_cost: float = 0.0) -> None:
        """`load_cost`, `prefill_cost`: seconds per token to read KV back from the disk
        tier and to compute it (the worker's start-up measurements)."""
        self.allocator, self.tree, self.page_size = allocator, tree, page_size
        self.load_cost, self.prefill_cost = load_cost, prefill_cost
        self.disk_loads = DiskLoads(allocator, tree)
        self.copies: list[tuple[int, int]] = []
        """Copy-on-write copies the step being planned needs; the step takes them."""
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
        """Blocks an allocation can get: free ones plus what eviction can reclaim (the
        `evictable_blocks`)."""
        return self.allocator.num_free + self.tree.evictable_blocks + len(self.partials)

    @staticmethod
    def splice(h: KVHandle, start: int, stop: int, blocks: list[int]) -> None:
        """`h.block_table[start:stop] = blocks`, marked as changed from `start` on: the one
        write to a table (an entry replaced, blocks appended, the tail cut, all of it), so
        the worker is told every change (`KVHandle.table_changed_from`)."""
        h.block_table[start:stop] = blocks
        h.table_changed_from = min(h.table_changed_from, start)

    def _reclaim(self, n: int) -> None:
        """Free at least `n` blocks if that many are evictable: partial blocks first (each
        saves less than a page of compute), then the tree's LRU leaves."""
        while n > 0 and self.partials:
            self.allocator.free([self.partials.popitem(last=False)[1]])
            n -= 1
        if n > 0:
            self.tree.evict(n)

    def blocks_for(self, handles: Iterable[KVHandle], n: int) -> int:
        """New blocks needed to give each of `handles` room for `n` more tokens (copies of
        shared last blocks included)."""
        need = 0
        for h in handles:
            need += self._new_pages(h, n) + self._shared_tail(h)
        return need

    def _new_pages(self, h: KVHandle, n: int) -> int:
        return max(0, -(-(h.kv_len + n) // self.page_size) - len(h.block_table))

    def _shared_tail(self, h: KVHandle) -> bool:
        """Whether the next write lands in a block someone else also holds."""
        i = h.kv_len // self.page_size
        return i < len(h.block_table) and self.allocator.refcount(h.block_table[i]) > 1

    def attach_prefix(self, h: KVHandle, tokens: list[int], limit: int) -> None:
        """Point an empty handle at the longest cached prefix of `tokens` (its sequence's,
        of which a hit may cover at most `limit`: `Req.prefix_limit`), locked against
        eviction."""
        match = self.tree.match_prefix(tokens, limit, namespace=h.namespace)
        self.tree.lock(match.node)
        self.allocator.incref(match.blocks)
        self.splice(h, 0, len(h.block_table), match.blocks)
        h.kv_len = h.tree_len = match.length
        h.node = match.node
        if self.partials:
            self._copy_partial(h, tokens, limit)

    def _copy_partial(self, h: KVHandle, tokens: list[int], limit: int) -> None:
        """Extend `h`'s match into the next page with a copy of a kept partial block that
        holds the tokens that follow (the longest such), if a block is free for it."""
        most = min(self.page_size - 1, limit - h.kv_len)
        if most <= 0 or not self.allocator.num_free:
            return
        assert h.node is not None
        following = tuple(tokens[h.kv_len:h.kv_len + most])
        for n in range(most, 0, -1):
            key = (h.namespace, h.node.id, following[:n])
            src = self.partials.get(key)
            if src is not None:
                self.partials.move_to_end(key)
                new = self.allocator.alloc(1)
                assert new is not None  # num_free was checked above
                (dst,) = new
                self.copies.append((src, dst))
                self.splice(h, len(h.block_table), len(h.block_table), [dst])
                h.kv_len += n
                self.partial_tokens += n
                return

    def _keep_partial(self, h: KVHandle, tokens: TokenReader) -> None:
        """Keep `h`'s part-filled last block (after `cache_progress`, which put the whole
        pages in the tree) for a request that continues the same tokens."""
        start, end = h.tree_len, h.kv_len
        if not self.tree.enabled or not 0 < end - start < self.page_size:
            return
        assert h.node is not None
        key = (h.namespace, h.node.id, tuple(tokens(start, end)))
        if key in self.partials:
            self.partials.move_to_end(key)
            return
        block = h.block_table[start // self.page_size]
        if self.allocator.refcount(block) > 1:
            return  # a fork still writes to it; and reclaiming it must free a block
        self.allocator.incref([block])
        self.partials[key] = block
        if len(self.partials) > self.max_partials:
            self._reclaim(1)

    def grow(self, h: KVHandle, n: int) -> int:
        """Make room for up to `n` more tokens in `h`, evicting cached prefixes if the free
        list is short and copying a shared last block; returns how many tokens fit (0 if not
        even one)."""
        page = self.page_size
        copy = self._shared_tail(h)
        pages = self._new_pages(h, n)
        short = pages + copy - self.allocator.num_free
        if short > 0:
            self._reclaim(short)
        free = self.allocator.num_free - copy
        if free < 0:
            return 0
        if pages > free:
            n = min(n, (len(h.block_table) + free) * page - h.kv_len)
            if n <= 0:
                return 0
            pages = self._new_pages(h, n)
        # Up to here `free` counted the blocks for `copy` and `pages`: both allocations succeed.
        if copy:
            i = h.kv_len // page
            new = self.allocator.alloc(1)
            assert new is not None
            src, (dst,) = h.block_table[i], new
            self.copies.append((src, dst))
            self.allocator.free([src])  # others still hold it: it stays allocated
            self.splice(h, i, i + 1, [dst])
            self.copied_blocks += 1
        if pages:  # continuing its table's run of ids where they are free
            after = h.block_table[-1] if h.block_table else None
            blocks = self.allocator.alloc(pages, after)
            assert blocks is not None
            self.splice(h, len(h.block_table), len(h.block_table), blocks)
        return n

    def truncate(self, h: KVHandle, kv_len: int) -> None:
        """`h` keeps the KV of its first `kv_len` tokens only (speculative decoding: a
        step wrote KV for draft tokens it then rejected). Its blocks past them go back
        (they were grown for the draft, so they are its own); the slots of the rejected
        tokens in its last block are simply written again later."""
        assert h.tree_len <= kv_len
        keep = -(-kv_len // self.page_size)
        self.allocator.free(h.block_table[keep:])
        self.splice(h, keep, len(h.block_table), [])
        h.kv_len = kv_len

    def start_load(self, h: KVHandle, tokens: list[int], limit: int,
                   room: int | None = None) -> bool:
        """After `attach_prefix` (same `tokens` and `limit`): if the disk tier holds more
        of the prefix and reading it is cheaper than computing it, let go of `h`'s blocks
        and ask the next step to load the rest (or, when another sequence's load already
        brings it, just wait). True when `h` now waits for a load. `room`: the most tokens
        of KV the sequence may add now (None: no limit); a load that would leave it no
        room to run is not started, since what it brings back would be evicted again
        before the sequence could use it."""
        tree = self.tree
        if tree.disk is None:
            return False
        assert h.node is not None
        match = tree.match_disk(h.node, tokens, h.kv_len, limit)
        if not match.nodes:
            return False
        if match.nodes[0].lock_count:  # being loaded already (only loads lock disk nodes)
            self.release(h)
            return True
        gain = match.length * self.prefill_cost
        if match.pages * self.page_size * self.load_cost >= gain:
            return False
        grows_by = match.pages * self.page_size + len(tokens) - h.kv_len - match.length
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
        self.release(h)  # its prefix in memory stays locked by the load
        h.loading = PrefixLoad(h, match, [n.disk_id for n in match.nodes], blocks)
        self.disk_loads.asked.append(h.loading)
        return True

    def fork(self, parent: KVHandle, child: KVHandle, tokens: TokenReader) -> None:
        """Let the empty `child` share all of `parent`'s KV by reference (`tokens`: the
        parent's). The parent's whole pages go into the tree first, so the siblings share
        nothing outside it but the last block."""
        self.cache_progress(parent, tokens)
        assert parent.node is not None
        self.tree.lock(parent.node)
        self.allocator.incref(parent.block_table)
        self.splice(child, 0, len(child.block_table), parent.block_table)
        child.kv_len, child.tree_len, child.node = parent.kv_len, parent.tree_len, parent.node

    def cache_progress(self, h: KVHandle, tokens: TokenReader, upto: int | None = None) -> None:
        """Insert the whole pages of `h`'s computed KV (`tokens`: its sequence's; of its
        first `upto` tokens only, if given) into the tree and move its lock there, so other
        sequences can share them while it keeps running. Where another sequence inserted
        the same tokens first, switch to the tree's blocks in one pass."""
        if not self.tree.enabled:
            return
        page = self.page_size
        aligned = (h.kv_len if upto is None else upto) // page * page
        if aligned <= h.tree_len:
            return
        assert h.node is not None
        inserted = self.tree.insert(tokens(0, aligned), h.block_table[:aligned // page],
                                    namespace=h.namespace)
        aligned = len(inserted.blocks) * page  # short of it only past a node being loaded
        table = h.block_table
        for i in range(h.tree_len // page, aligned // page):
            canonical = inserted.blocks[i]
            if table[i] != canonical:
                self.allocator.incref([canonical])
                self.allocator.free([table[i]])
                self.splice(h, i, i + 1, [canonical])
        self.tree.lock(inserted.node)
        self.tree.unlock(h.node)
        h.node, h.tree_len = inserted.node, aligned

    def release(self, h: KVHandle, keep: TokenReader | None = None) -> None:
        """Drop all of `h`'s KV: unlock its prefix and drop its references. With `keep`
        (its sequence's tokens), cache its computed pages and keep its part-filled last
        block first; without, they go uncached. The handle can be attached again later."""
        if h.loading is not None:
            if h.loading.pending:  # in a step in flight (overlap): hold nothing for it
                h.loading = None
            else:
                self.disk_loads.drop_hold(h)
        if h.node is None:
            return
        if keep is not None:
            self.cache_progress(h, keep)
            self._keep_partial(h, keep)
        if self.copies:  # planned this step into blocks of `h` that are about to go
            mine = set(h.block_table)
            self.copies = [c for c in self.copies if c[1] not in mine]
        self.tree.unlock(h.node)
        self.allocator.free(h.block_table)
        self.splice(h, 0, len(h.block_table), [])
        h.kv_len, h.tree_len, h.node = 0, 0, None

    def flush(self) -> None:
        """Drop every cached prefix and kept partial block (nothing may be running)."""
        self.tree.flush()
        self.flush_partials()

    def flush_partials(self) -> None:
        self.allocator.free(self.partials.values())
        self.partials.clear()

    def check_invariants(self, holding: Iterable[tuple[str, KVHandle]]) -> None:
        """Every block's count equals its holders (the tree, the loads on their way back
        from disk, each (name, handle) in `holding`); the free list is exactly the blocks
        nobody holds; a handle holds tree blocks only on the path it keeps locked. Raises
        AssertionError otherwise."""
        self.tree.check_invariants()
        holding = list(holding)
        tree_blocks = self.tree.all_blocks()
        assert self.tree.evictable_blocks + self.tree.locked_blocks == len(tree_blocks)
        self.allocator.check_holders([tree_blocks, list(self.partials.values()),
                                      self.disk_loads.blocks(),
                                      *(h.block_table for _, h in holding)])
        assert all(self.allocator.refcount(b) == 1 for b in self.partials.values()), \
            "a kept partial block has another holder: reclaiming it would free nothing"
        in_tree = set(tree_blocks)
        page = self.page_size
        for name, h in holding:
            table = h.block_table
            assert set(table[:h.tree_len // page]) <= in_tree, \
                f"{name} uses blocks the tree no longer holds"
            outside = in_tree.intersection(table[h.tree_len // page:])
            assert not outside, \
                f"{name} holds tree blocks {sorted(outside)} off its locked path"
