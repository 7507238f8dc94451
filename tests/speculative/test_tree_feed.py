"""The radix tree feeds its SuffixIndex (cache/token_index.py): after every operation the
index equals one rebuilt from scratch from what the tree holds (the "kept in step"
invariant), through inserts, splits, evictions, spills to disk and back, drops from disk,
restores and flushes with and without pins."""

from __future__ import annotations

import random
from array import array

import pytest

from radixserve.cache import BlockAllocator, RadixCache, RadixNode
from radixserve.cache.disk import DiskTier
from radixserve.speculative.suffix_index import SuffixIndex


def rebuilt(cache: RadixCache, like: SuffixIndex) -> SuffixIndex:
    """An index with ``like``'s settings, fed every indexed node of the tree from scratch,
    each with the whole path above it."""
    fresh = SuffixIndex(like.max_context, like.min_match, like.min_prob, like.max_tokens)
    for node in cache.nodes():
        if node.indexed:
            path = list(cache.tree.path(node))  # node first, the root's child last
            above = [t for n in reversed(path[1:]) for t in n.tokens]
            assert fresh.add(path[-1].namespace, above, node.tokens)
    return fresh


def assert_in_step(cache: RadixCache, index: SuffixIndex, bounded: bool = False) -> None:
    cache.check_invariants()
    if not bounded:  # every edge with tokens is indexed
        assert all(n.indexed == bool(len(n.tokens)) for n in cache.nodes())
    fresh = rebuilt(cache, index)
    assert index.snapshot() == fresh.snapshot() and index.tokens == fresh.tokens
    assert index.tokens <= index.max_tokens


def put(cache: RadixCache, tokens: list[int], namespace: str | None = None) -> RadixNode:
    """Insert like a finished request, evicting for room when the pool is short."""
    pages = len(tokens) // cache.page_size
    blocks = cache.allocator.alloc(pages)
    if blocks is None:
        cache.evict(pages - cache.allocator.num_free)
        blocks = cache.allocator.alloc(pages)
    assert blocks is not None
    result = cache.insert(tokens, blocks, namespace=namespace)
    cache.allocator.free(blocks)
    return result.node


@pytest.mark.parametrize("page_size,disk_pages", [(1, 0), (2, 0), (1, 40), (2, 24)])
def test_the_index_stays_in_step_with_the_tree(page_size: int, disk_pages: int) -> None:
    rng = random.Random(page_size * 100 + disk_pages)
    index = SuffixIndex(max_context=6, min_match=2)
    disk = DiskTier(disk_pages * 100, 100) if disk_pages else None
    cache = RadixCache(BlockAllocator(48), page_size, disk=disk, token_index=index)
    seqs: list[tuple[str | None, list[int]]] = []
    for _ in range(300):
        op = rng.random()
        if op < 0.6 or not seqs:  # a new sequence, often branching off an earlier one
            ns = rng.choice([None, None, "alice", "bob"])
            base = [s for n, s in seqs if n == ns and rng.random() < 0.7]
            stem = rng.choice(base)[:rng.randrange(0, 40)] if base else []
            tokens = stem + [rng.randrange(6) for _ in range(rng.randrange(1, 24))]
            tokens = tokens[:len(tokens) - len(tokens) % page_size]
            if len(tokens) // page_size > 48:
                continue
            put(cache, tokens, ns)
            seqs.append((ns, tokens))
        elif op < 0.75:  # a match that splits an edge where it ends
            ns, tokens = rng.choice(seqs)
            cache.match_prefix(tokens[:rng.randrange(len(tokens) + 1)], namespace=ns)
        elif op < 0.9:
            cache.evict(rng.randrange(1, 16))
        elif op < 0.95:
            cache.flush()
        else:  # a flush around a pinned prefix, which stays
            ns, tokens = rng.choice(seqs)
            node = put(cache, tokens, ns)
            if not node.is_root:
                cache.pin(node)
                cache.flush()
                assert_in_step(cache, index)
                cache.unpin(node)
        assert_in_step(cache, index)
    assert index.tokens > 0 or cache.num_nodes == 0


def test_a_restored_disk_node_is_indexed_and_its_drop_is_told() -> None:
    index = SuffixIndex(max_context=4)
    cache = RadixCache(BlockAllocator(8), 1, disk=DiskTier(1000, 100), token_index=index)
    top = cache.restore_disk_node(cache.tree.namespace_node("alice", create=True),
                                  array("q", [1, 2, 3, 4]), 1, 0)
    cache.restore_disk_node(top, array("q", [5, 6]), 2, 0)
    assert_in_step(cache, index)
    assert index.propose("alice", [2, 3], 3) == [4, 5, 6]
    cache.make_disk_room(10**6 // 100)  # nothing to drop: it fits
    cache.disk.capacity_bytes = 0
    cache.make_disk_room(0)  # both go
    assert cache.num_nodes == 0 and index.tokens == 0
    assert_in_step(cache, index)


def test_what_the_tree_forgets_is_no_longer_proposed() -> None:
    index = SuffixIndex(max_context=4)
    cache = RadixCache(BlockAllocator(32), 1, token_index=index)
    put(cache, [1, 2, 3, 4, 5, 6, 7], "alice")
    assert index.propose("alice", [9, 2, 3], 4) == [4, 5, 6, 7]
    assert index.propose("bob", [9, 2, 3], 4) == []  # another tenant sees nothing of it
    assert index.propose(None, [9, 2, 3], 4) == []
    cache.evict(32)
    assert cache.num_nodes == 0 and index.propose("alice", [9, 2, 3], 4) == []


def test_a_full_index_skips_nodes_and_forgets_only_what_it_counted() -> None:
    rng = random.Random(3)
    index = SuffixIndex(max_context=4, max_tokens=40)
    cache = RadixCache(BlockAllocator(64), 1, token_index=index)
    skipped = 0
    for _ in range(200):
        put(cache, [rng.randrange(5) for _ in range(rng.randrange(4, 16))])
        skipped += sum(not n.indexed and len(n.tokens) > 0 for n in cache.nodes()) > 0
        if rng.random() < 0.3:
            cache.evict(rng.randrange(1, 20))
        assert_in_step(cache, index, bounded=True)
    assert skipped  # the bound was reached, and the tree and the index stayed consistent


def test_a_disabled_cache_feeds_nothing() -> None:
    class Refuses:
        max_context = 4

        def add(self, *args: object) -> bool:
            raise AssertionError("fed by a disabled cache")

        remove = clear = add

    cache = RadixCache(BlockAllocator(8), 1, enabled=False, token_index=Refuses())
    put(cache, [1, 2, 3])
    cache.evict(8)
    cache.flush()


def test_removing_a_namespace_node_removes_its_subtree_from_its_namespace() -> None:
    """The cache removes a namespace node only once it is empty, but the feed does not rely
    on it: told a namespace node goes, it takes that namespace's counts of everything below."""
    index = SuffixIndex(max_context=4)
    cache = RadixCache(BlockAllocator(32), 1, token_index=index)
    put(cache, [1, 2, 3, 4], "alice")
    put(cache, [1, 2, 5, 6], "alice")  # a split below the namespace node
    put(cache, [1, 2, 3, 4])
    cache.index.removing(cache.root.children["alice"])
    assert set(index.snapshot()) == {None}
    assert index.tokens == 4
