"""RadixCache namespaces (tenants, cache_salt): the namespace is part of the key from the
root, so nothing one namespace caches is visible to another, while locks, eviction, flush
and the block accounting stay exact across all of them."""

from __future__ import annotations

import pytest

from radixserve.cache import BlockAllocator, RadixCache
from radixserve.cache.disk import DiskTier
from tests.cache.test_radix_cache import assert_accounted, new_cache, put


def put_ns(cache: RadixCache, tokens: list[int], namespace: str | None):
    blocks = cache.allocator.alloc(len(tokens) // cache.page_size)
    assert blocks is not None
    result = cache.insert(tokens, blocks, namespace=namespace)
    cache.allocator.free(blocks)
    return result


@pytest.mark.parametrize("page_size", [1, 4])
def test_namespaces_never_share_prefixes(page_size: int) -> None:
    alloc, cache = new_cache(page_size)
    tokens = list(range(4 * page_size))
    a = put_ns(cache, tokens, "tenant-a")
    assert a.prefix_len == 0
    # Neither the default namespace nor another one sees A's prefix, peek or not.
    for ns in (None, "tenant-b"):
        assert cache.match_prefix(tokens + [99], namespace=ns, peek=True).length == 0
        m = cache.match_prefix(tokens + [99], namespace=ns)
        assert (m.length, m.blocks, m.node) == (0, [], cache.root)
    # A's own namespace does.
    m = cache.match_prefix(tokens + [99], namespace="tenant-a")
    assert m.length == len(tokens) and m.node is a.node and m.blocks == a.blocks
    # The same tokens in B are a second copy with their own blocks.
    b = put_ns(cache, tokens, "tenant-b")
    assert b.prefix_len == 0 and set(b.blocks).isdisjoint(a.blocks)
    assert cache.cached_tokens == 2 * len(tokens)
    assert cache.match_prefix(tokens + [99], namespace="tenant-b").blocks == b.blocks
    assert_accounted(alloc, cache)


def test_namespace_node_is_an_empty_root_child_and_holds_no_blocks() -> None:
    alloc, cache = new_cache(1)
    put_ns(cache, [1, 2, 3], "ns")
    ns_node = cache.root.children["ns"]
    assert ns_node.is_namespace and len(ns_node.tokens) == 0 and len(ns_node.blocks) == 0
    assert cache.num_nodes == 2  # the namespace node and the edge below it
    assert cache.evictable_blocks == 3
    assert_accounted(alloc, cache)


def test_split_in_one_namespace_leaves_the_other_alone() -> None:
    alloc, cache = new_cache(1)
    put_ns(cache, [1, 2, 3, 4], "a")
    put_ns(cache, [1, 2, 3, 4], "b")
    r = put_ns(cache, [1, 2, 9], "a")  # splits a's edge after [1, 2]
    assert r.prefix_len == 2
    b_edge = next(iter(cache.root.children["b"].children.values()))
    assert b_edge.tokens.tolist() == [1, 2, 3, 4] and b_edge.is_leaf
    assert cache.match_prefix([1, 2, 3, 4, 5], namespace="b").length == 4
    assert cache.match_prefix([1, 2, 9, 5], namespace="b").length == 2
    assert_accounted(alloc, cache)


def test_default_namespace_is_the_root() -> None:
    alloc, cache = new_cache(1)
    r = put(cache, [5, 6, 7])
    assert cache.match_prefix([5, 6, 7, 8]).length == 3
    assert cache.match_prefix([5, 6, 7, 8], namespace="x").length == 0
    assert r.node.parent_id == cache.root.id
    assert_accounted(alloc, cache)


def test_locks_and_eviction_across_namespaces() -> None:
    alloc, cache = new_cache(1, num_blocks=12)
    a = put_ns(cache, [1, 2, 3, 4], "a")
    b = put_ns(cache, [1, 2, 3, 4], "b")
    c = put(cache, [1, 2, 3, 4])
    cache.lock(b.node)
    assert cache.locked_blocks == 4 and cache.evictable_blocks == 8
    assert cache.root.children["b"].lock_count == 1
    assert_accounted(alloc, cache)
    # LRU across namespaces: a (oldest) goes first, then its empty namespace node.
    assert cache.evict(4) == 4
    assert "a" not in cache.root.children
    assert cache.match_prefix([1, 2, 3, 4, 5], namespace="a").length == 0
    assert_accounted(alloc, cache)
    # b is locked: only the default namespace's c can go.
    assert cache.evict(100) == 4
    assert cache.match_prefix([1, 2, 3, 4, 5]).length == 0
    assert cache.match_prefix([1, 2, 3, 4, 5], namespace="b").length == 4
    assert_accounted(alloc, cache)
    cache.unlock(b.node)
    assert cache.evict(100) == 4 and cache.num_nodes == 0
    assert alloc.num_free == alloc.num_blocks
    assert_accounted(alloc, cache)
    del a, c


def test_empty_match_in_a_namespace_can_be_locked() -> None:
    """An empty match in a namespace that exists ends at its node; locking it keeps the
    namespace node and nothing else, and costs no block."""
    alloc, cache = new_cache(1)
    put_ns(cache, [1, 2], "a")
    m = cache.match_prefix([7, 8, 9], namespace="a")
    assert m.length == 0 and m.node.is_namespace
    cache.lock(m.node)
    assert cache.locked_blocks == 0
    assert cache.evict(100) == 2
    assert "a" in cache.root.children  # locked: stays, empty
    assert_accounted(alloc, cache)
    cache.unlock(m.node)
    assert cache.evict(1) == 0 and "a" not in cache.root.children
    assert_accounted(alloc, cache)


def test_flush_empties_every_namespace() -> None:
    alloc, cache = new_cache(2)
    for ns in (None, "a", "b"):
        put_ns(cache, [1, 2, 3, 4], ns)
    assert alloc.num_free == alloc.num_blocks - 6
    cache.flush()
    assert alloc.num_free == alloc.num_blocks and cache.num_nodes == 0
    for ns in (None, "a", "b"):
        assert cache.match_prefix([1, 2, 3, 4, 5], namespace=ns).length == 0
    assert_accounted(alloc, cache)


def test_invalid_namespace_is_refused() -> None:
    _, cache = new_cache(1)
    for bad in ("", 3, (1, 2), b"x"):
        with pytest.raises(ValueError, match="namespace"):
            cache.match_prefix([1, 2], namespace=bad)  # type: ignore[arg-type]


def test_disabled_cache_ignores_namespaces() -> None:
    alloc, cache = new_cache(1, enabled=False)
    r = cache.insert([1, 2], alloc.alloc(2), namespace="a")
    assert r.node is cache.root
    assert cache.match_prefix([1, 2, 3], namespace="a").length == 0


def test_invariant_catches_a_namespace_node_holding_tokens() -> None:
    alloc = BlockAllocator(8)
    cache = RadixCache(alloc, 1)
    put_ns(cache, [1, 2], "a")
    from array import array
    cache.root.children["a"].tokens = array("q", [1])
    with pytest.raises(AssertionError, match="namespace node"):
        cache.check_invariants()


def test_random_ops_over_namespaces_keep_the_invariant() -> None:
    import random
    rng = random.Random(7)
    alloc, cache = new_cache(2, num_blocks=40)
    locked = []
    for _ in range(400):
        ns = rng.choice([None, "a", "b", "c"])
        tokens = [rng.randrange(3) for _ in range(2 * rng.randrange(1, 5))]
        op = rng.random()
        if op < 0.45:
            need = len(tokens) // 2
            if alloc.num_free < need:
                cache.evict(need - alloc.num_free)
            if alloc.num_free >= need:
                r = put_ns(cache, tokens, ns)
                if rng.random() < 0.3:
                    cache.lock(r.node)
                    locked.append(r.node)
        elif op < 0.75:
            m = cache.match_prefix(tokens + [0], namespace=ns)
            if rng.random() < 0.3:
                cache.lock(m.node)
                locked.append(m.node)
        elif op < 0.9 and locked:
            cache.unlock(locked.pop(rng.randrange(len(locked))))
        else:
            cache.evict(rng.randrange(1, 6))
        cache.check_invariants()
        assert alloc.num_free + cache.evictable_blocks + cache.locked_blocks == alloc.num_blocks
    for node in locked:
        cache.unlock(node)
    cache.flush()
    assert alloc.num_free == alloc.num_blocks


def test_an_insert_that_drops_a_namespaces_only_disk_child_keeps_the_namespace() -> None:
    """The insert diverges inside the namespace's only edge, which is on disk: that edge is
    dropped, which empties the namespace node, and the new leaf still hangs below it."""
    cache = RadixCache(BlockAllocator(4), 1, disk=DiskTier(1000, 100))
    put_ns(cache, [1, 2, 3], "a")
    cache.evict(3)  # to disk
    put_ns(cache, [1, 2, 9], "a")
    cache.check_invariants()
    assert cache.match_prefix([1, 2, 9], namespace="a").length == 3
