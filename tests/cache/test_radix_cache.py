"""RadixCache unit tests: match, insert, split, duplicates, locks, LRU eviction, flush."""

from __future__ import annotations

import gc
from collections.abc import Sequence

import pytest

from radixserve.cache import BlockAllocator, InsertResult, RadixCache, RadixNode


def new_cache(page_size: int = 1, num_blocks: int = 64,
              enabled: bool = True) -> tuple[BlockAllocator, RadixCache]:
    alloc = BlockAllocator(num_blocks)
    return alloc, RadixCache(alloc, page_size, enabled=enabled)


def put(cache: RadixCache, tokens: Sequence[int]) -> InsertResult:
    """Insert like a finished request: fresh blocks in, then the caller lets go of its own
    references (the tree keeps those it adopted)."""
    blocks = cache.allocator.alloc(len(tokens) // cache.page_size)
    assert blocks is not None
    result = cache.insert(tokens, blocks)
    cache.allocator.free(blocks)
    return result


def path_of(cache: RadixCache, node: RadixNode) -> list[int]:
    """The tokens from the root to the end of `node`."""
    parts = []
    while not node.is_root:
        parts.append(node.tokens.tolist())
        node = cache.tree.parent(node)
    return [t for part in reversed(parts) for t in part]


def assert_accounted(alloc: BlockAllocator, cache: RadixCache) -> None:
    cache.check_invariants()
    assert alloc.num_free + cache.evictable_blocks + cache.locked_blocks == alloc.num_blocks


class TestMatchAndInsert:
    def test_empty_tree_matches_nothing_at_root(self) -> None:
        _, cache = new_cache()
        m = cache.match_prefix([1, 2, 3])
        assert (m.length, m.blocks, m.node) == (0, [], cache.root)

    @pytest.mark.parametrize("page_size", [1, 4])
    def test_insert_then_match(self, page_size: int) -> None:
        alloc, cache = new_cache(page_size)
        tokens = list(range(3 * page_size))
        r = put(cache, tokens)
        assert r.prefix_len == 0 and r.blocks == [0, 1, 2]
        m = cache.match_prefix(tokens + [99])
        assert m.length == len(tokens) and m.node is r.node
        assert m.blocks == r.node.blocks.tolist() == [0, 1, 2]
        assert cache.cached_tokens == len(tokens)
        assert_accounted(alloc, cache)

    def test_match_respects_max_len_and_rounds_down_to_pages(self) -> None:
        alloc, cache = new_cache(page_size=4)
        tokens = list(range(12))
        put(cache, tokens)
        assert cache.match_prefix(tokens, max_len=11).length == 8
        assert cache.match_prefix(tokens, max_len=12).length == 12
        assert cache.match_prefix(tokens, max_len=100).length == 12
        assert cache.match_prefix(tokens, max_len=3).length == 0
        assert cache.match_prefix(tokens, max_len=0).length == 0
        assert cache.match_prefix(tokens[:7]).length == 4
        assert cache.match_prefix(tokens[:6] + [99, 99]).length == 4  # mismatch inside a page
        m = cache.match_prefix(tokens, max_len=11)
        assert m.blocks == [0, 1] and path_of(cache, m.node) == tokens[:8]
        assert_accounted(alloc, cache)

    @pytest.mark.parametrize("page_size", [1, 4])
    def test_split_mid_edge_keeps_both_halves_blocks(self, page_size: int) -> None:
        alloc, cache = new_cache(page_size)
        tokens = list(range(4 * page_size))
        whole = put(cache, tokens).node
        m = cache.match_prefix(tokens[:2 * page_size] + [-1] * page_size)
        assert m.length == 2 * page_size and m.blocks == [0, 1]
        assert cache.num_nodes == 2 and path_of(cache, m.node) == tokens[:2 * page_size]
        # The old handle keeps meaning "ends after all 4 pages": it kept the lower half.
        assert whole.blocks.tolist() == [2, 3] and whole.parent_id == m.node.id
        assert path_of(cache, whole) == tokens
        assert cache.match_prefix(tokens).blocks == [0, 1, 2, 3]
        assert_accounted(alloc, cache)

    def test_diverging_insert_splits_and_branches(self) -> None:
        alloc, cache = new_cache(page_size=2)
        put(cache, [1, 2, 3, 4, 5, 6])
        r = put(cache, [1, 2, 3, 4, 7, 8, 9, 9])
        assert r.prefix_len == 4 and r.blocks == [0, 1, 5, 6]
        assert path_of(cache, r.node) == [1, 2, 3, 4, 7, 8, 9, 9]
        assert cache.match_prefix([1, 2, 3, 4, 5, 6]).blocks == [0, 1, 2]
        assert cache.match_prefix([1, 2, 3, 4, 7, 8, 9, 9]).blocks == [0, 1, 5, 6]
        assert_accounted(alloc, cache)

    def test_reinsert_of_shared_prefix_names_the_trees_blocks_as_canonical(self) -> None:
        alloc, cache = new_cache()
        put(cache, [1, 2, 3])
        fresh = alloc.alloc(5) or []
        r = cache.insert([1, 2, 3, 4, 5], fresh)
        assert r.prefix_len == 3 and r.blocks == [0, 1, 2] + fresh[3:]
        assert cache.match_prefix([1, 2, 3, 4, 5]).blocks == [0, 1, 2] + fresh[3:]
        assert [alloc.refcount(b) for b in fresh] == [1, 1, 1, 2, 2]  # caller + tree
        alloc.free(fresh)
        assert_accounted(alloc, cache)
        again = put(cache, [1, 2, 3, 4, 5])
        assert again.prefix_len == 5 and again.blocks == [0, 1, 2] + fresh[3:]

    def test_blocks_from_match_are_canonical(self) -> None:
        """The matched blocks are the tree's own: nothing to swap."""
        alloc, cache = new_cache()
        put(cache, [1, 2, 3])
        m = cache.match_prefix([1, 2, 3, 4, 5])
        cache.lock(m.node)
        private = alloc.alloc(2) or []
        r = cache.insert([1, 2, 3, 4, 5], m.blocks + private)
        assert r.prefix_len == 3 and r.blocks == m.blocks + private
        alloc.free(private)  # the caller's references; the tree took its own
        cache.lock(r.node)
        cache.unlock(m.node)
        assert cache.locked_blocks == 5
        assert_accounted(alloc, cache)

    def test_insert_validates_whole_pages_and_block_count(self) -> None:
        alloc, cache = new_cache(page_size=4)
        with pytest.raises(ValueError, match="multiple"):
            cache.insert([1, 2, 3], [0])
        with pytest.raises(ValueError, match="blocks"):
            cache.insert(list(range(8)), [0])
        r = cache.insert([], [])
        assert r.node is cache.root and r.prefix_len == 0

    def test_peek_changes_nothing(self) -> None:
        _, cache = new_cache()
        leaf = put(cache, [1, 2, 3, 4]).node
        before = (cache.num_nodes, cache.hit_tokens, cache.miss_tokens, leaf.last_access)
        m = cache.match_prefix([1, 2, 9], peek=True)
        assert m.length == 2 and m.blocks == [0, 1]
        assert m.node is leaf  # the node whose edge contains the end of the match
        assert (cache.num_nodes, cache.hit_tokens, cache.miss_tokens, leaf.last_access) == before

    def test_stats(self) -> None:
        _, cache = new_cache()
        put(cache, [1, 2])
        match = cache.match_prefix([1, 2, 3, 4])
        cache.record_lookup(match.node, match.length, 4)
        s = cache.stats()
        assert (s["hit_tokens"], s["miss_tokens"], s["cached_tokens"]) == (2, 2, 2)
        assert s["hit_rate"] == 0.5 and s["num_nodes"] == 1 and s["evictable_blocks"] == 2


class TestLocksAndEviction:
    def test_lock_prevents_eviction(self) -> None:
        alloc, cache = new_cache()
        a = put(cache, [1, 2, 3]).node
        put(cache, [5, 6])
        cache.lock(a)
        assert (cache.locked_blocks, cache.evictable_blocks) == (3, 2)
        assert cache.evict(100) == 2
        assert cache.match_prefix([1, 2, 3]).length == 3
        assert_accounted(alloc, cache)
        cache.unlock(a)
        assert cache.evict(100) == 3 and alloc.num_free == alloc.num_blocks
        assert_accounted(alloc, cache)

    def test_locking_a_child_locks_ancestors(self) -> None:
        _, cache = new_cache()
        put(cache, [1, 2, 3])
        child = put(cache, [1, 2, 4]).node
        parent = cache.tree.parent(child)
        cache.lock(child)
        cache.lock(child)
        assert (child.lock_count, parent.lock_count) == (2, 2)
        assert cache.evict(10) == 1  # only the sibling leaf [3]
        cache.unlock(child)
        cache.unlock(child)
        with pytest.raises(RuntimeError, match="unlock"):
            cache.unlock(child)
        cache.check_invariants()

    def test_split_of_locked_edge_keeps_both_halves_locked(self) -> None:
        alloc, cache = new_cache(page_size=2)
        node = put(cache, [1, 2, 3, 4]).node
        cache.lock(node)
        upper = cache.match_prefix([1, 2, 9, 9]).node
        assert upper.lock_count == 1 and cache.locked_blocks == 2
        assert cache.evict(10) == 0
        cache.unlock(node)
        assert upper.lock_count == 0 and cache.evictable_blocks == 2
        assert_accounted(alloc, cache)

    def test_evicted_handle_is_stale(self) -> None:
        _, cache = new_cache()
        node = put(cache, [1, 2]).node
        cache.evict(1)
        with pytest.raises(ValueError, match="stale"):
            cache.lock(node)

    def test_evicts_least_recently_used_first(self) -> None:
        alloc, cache = new_cache()
        put(cache, [1, 1])
        put(cache, [2, 2])
        put(cache, [3, 3])
        cache.match_prefix([1, 1])  # now [2, 2] is the oldest
        assert cache.evict(1) == 2
        assert cache.match_prefix([2, 2], peek=True).length == 0
        assert cache.match_prefix([1, 1], peek=True).length == 2
        assert cache.evict(1) == 2  # then [3, 3]
        assert cache.match_prefix([3, 3], peek=True).length == 0
        assert_accounted(alloc, cache)

    def test_parent_becomes_candidate_after_its_children(self) -> None:
        alloc, cache = new_cache()
        put(cache, [1, 2, 3])
        put(cache, [1, 2, 4])  # splits: [1, 2] -> {[3], [4]}
        assert cache.num_nodes == 3
        assert cache.evict(2) == 2  # both leaves; the (more recent) parent survives
        assert cache.match_prefix([1, 2, 3], peek=True).length == 2
        assert cache.evict(1) == 2  # whole parent leaf, more than asked
        assert cache.num_nodes == 0 and alloc.num_free == alloc.num_blocks
        assert cache.evicted_tokens == 4
        assert cache.evict(1) == 0
        assert_accounted(alloc, cache)


class TestFlushAndDisabled:
    @pytest.mark.parametrize("page_size", [1, 4])
    def test_flush_frees_everything(self, page_size: int) -> None:
        alloc, cache = new_cache(page_size)
        for first in range(3):
            put(cache, [first] * (2 * page_size))
        node = put(cache, [0] * (3 * page_size)).node
        cache.lock(node)
        with pytest.raises(RuntimeError, match="locked"):
            cache.flush()
        cache.unlock(node)
        cache.flush()
        assert alloc.num_free == alloc.num_blocks and cache.num_nodes == 0
        assert cache.cached_tokens == cache.evictable_blocks == cache.locked_blocks == 0
        with pytest.raises(ValueError, match="stale"):
            cache.lock(node)
        put(cache, [7] * page_size)  # still usable
        assert_accounted(alloc, cache)

    def test_disabled_cache_adopts_nothing(self) -> None:
        alloc, cache = new_cache(enabled=False)
        blocks = alloc.alloc(3) or []
        r = cache.insert([1, 2, 3], blocks)
        assert (r.prefix_len, r.blocks, r.node) == (3, blocks, cache.root)
        assert [alloc.refcount(b) for b in blocks] == [1, 1, 1]
        alloc.free(blocks)
        m = cache.match_prefix([1, 2, 3])
        assert (m.length, m.blocks, m.node) == (0, [], cache.root)
        cache.lock(m.node)
        cache.unlock(m.node)
        cache.unlock(m.node)  # no-op on the root, never raises
        assert cache.cached_tokens == 0
        assert_accounted(alloc, cache)


class TestDebugSupport:
    def test_check_invariants_catches_corrupted_counter(self) -> None:
        _, cache = new_cache()
        put(cache, [1, 2])
        cache.tree.evictable_blocks += 1
        with pytest.raises(AssertionError, match="counters"):
            cache.check_invariants()

    def test_check_invariants_catches_block_freed_behind_the_trees_back(self) -> None:
        alloc, cache = new_cache()
        put(cache, [1, 2])
        alloc.free([0])
        with pytest.raises(AssertionError, match="free in the allocator"):
            cache.check_invariants()

    def test_tree_has_no_reference_cycles(self) -> None:
        """Dropping a populated cache must free it by refcounting alone."""
        gc.collect()
        gc.disable()
        try:
            _, cache = new_cache(num_blocks=512)
            for i in range(50):
                put(cache, [i % 5, i % 7, i % 3, i])
                cache.match_prefix([i % 5, i % 7, 9])
            del cache
            assert gc.collect() == 0
        finally:
            gc.enable()
