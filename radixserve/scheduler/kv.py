"""Block bookkeeping for requests: what they take from the tree, the allocator, and give back.

A request's `block_table` is split at `tree_len`: blocks before it are the radix tree's
(alive while the request's lock on `node` holds), blocks after it are private (refcount
1). These methods are the only places that move blocks between the two, so the invariant
`free + evictable + locked + private == total` is kept here.
"""

from __future__ import annotations

from radixserve.cache.allocator import BlockAllocator
from radixserve.cache.radix import RadixCache
from radixserve.scheduler.request import Req


class KVManager:
    def __init__(self, allocator: BlockAllocator, tree: RadixCache, page_size: int) -> None:
        self.allocator, self.tree, self.page_size = allocator, tree, page_size

    @property
    def available_blocks(self) -> int:
        """Blocks an allocation can get: free ones plus what eviction can reclaim."""
        return self.allocator.num_free + self.tree.evictable_blocks

    def blocks_for(self, reqs: list[Req], n: int) -> int:
        """New blocks needed to give each of `reqs` room for `n` more tokens."""
        page = self.page_size
        return sum(max(0, -(-(r.kv_len + n) // page) - len(r.block_table)) for r in reqs)

    def attach_prefix(self, req: Req) -> None:
        """Point a waiting request at its longest cached prefix, locked against eviction."""
        match = self.tree.match_prefix(req.tokens(0, req.seq_len), req.prefix_limit)
        self.tree.lock(match.node)
        req.block_table = list(match.blocks)
        req.kv_len = req.tree_len = match.length
        req.node = match.node

    def grow(self, req: Req, n: int) -> int:
        """Make room for up to `n` more tokens of `req`, evicting cached prefixes if the free
        list is short; returns how many tokens fit (0 if not even one)."""
        page = self.page_size
        need = -(-(req.kv_len + n) // page) - len(req.block_table)
        short = need - self.allocator.num_free
        if short > 0:
            self.tree.evict(short)
        free = self.allocator.num_free
        if need > free:
            need = free
            n = min(n, (len(req.block_table) + free) * page - req.kv_len)
            if n <= 0:
                return 0
        if need > 0:
            req.block_table.extend(self.allocator.alloc(need))
        return n

    def cache_progress(self, req: Req) -> None:
        """Insert the whole pages of `req`'s computed KV into the tree and move its lock
        there, so other requests can share them while it keeps running. Where another
        request inserted the same tokens first, switch to the tree's blocks and free ours."""
        if not self.tree.enabled:
            return
        page = self.page_size
        aligned = req.kv_len // page * page
        if aligned <= req.tree_len:
            return
        tokens = req.tokens(0, aligned)
        inserted = self.tree.insert(tokens, req.block_table[:aligned // page])
        if inserted.duplicate_blocks:  # else the tree now holds exactly our blocks
            shared = self.tree.match_prefix(tokens, aligned, peek=True).blocks
            for i in range(req.tree_len // page, aligned // page):
                if req.block_table[i] != shared[i]:
                    self.allocator.free([req.block_table[i]])
                    req.block_table[i] = shared[i]
        self.tree.lock(inserted.node)
        self.tree.unlock(req.node)
        req.node, req.tree_len = inserted.node, aligned

    def release(self, req: Req, cache: bool) -> None:
        """Drop all of `req`'s KV: cache its computed pages first if `cache`, unlock its
        prefix, free its private blocks. The request can be attached again later."""
        if req.node is None:
            return
        if cache:
            self.cache_progress(req)
        self.tree.unlock(req.node)
        self.allocator.free(req.block_table[req.tree_len // self.page_size:])
        req.block_table, req.kv_len, req.tree_len, req.node = [], 0, 0, None

    def check_invariants(self, running: list[Req]) -> None:
        """Every block is exactly one of: free, in the tree (evictable or locked), or private
        to one running request; refcounts agree. Raises AssertionError otherwise."""
        self.tree.check_invariants()
        page = self.page_size
        total = self.allocator.num_blocks
        tree_blocks = set(self.tree.all_blocks())
        private: list[int] = []
        for req in running:
            private.extend(req.block_table[req.tree_len // page:])
            assert set(req.block_table[:req.tree_len // page]) <= tree_blocks, \
                f"{req.rid} uses blocks the tree no longer holds"
        assert len(private) == len(set(private)), "a private block is held twice"
        assert not tree_blocks & set(private), "a block is both cached and private"
        assert self.tree.evictable_blocks + self.tree.locked_blocks == len(tree_blocks)
        free = self.allocator.num_free
        assert free + len(tree_blocks) + len(private) == total, (
            f"block leak: free {free} + evictable {self.tree.evictable_blocks} + locked "
            f"{self.tree.locked_blocks} + private {len(private)} != total {total}")
        for b in private:
            assert self.allocator.refcount(b) == 1, f"private block {b} has refcount != 1"
