"""RadixCache's page hashes and events (what a cache-aware router reads): the hashes stored
are `page_hashes` of the inserted tokens, splits keep them, eviction reports them removed,
flush reports cleared, namespaces hash apart, and check_invariants catches a wrong hash."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import pytest

from radixserve.cache import BlockAllocator, RadixCache, TreeEvents
from radixserve.cache.events import page_hashes


def new_cache(page_size: int = 4, num_blocks: int = 64, enabled: bool = True) -> RadixCache:
    return RadixCache(BlockAllocator(num_blocks), page_size, enabled=enabled, record_events=True)


def put(cache: RadixCache, tokens: Sequence[int], namespace: str | None = None) -> None:
    """Insert like a finished request (fresh blocks; the caller then drops its own refs)."""
    blocks = cache.allocator.alloc(len(tokens) // cache.page_size)
    assert blocks is not None
    cache.insert(tokens, blocks, namespace=namespace)
    cache.allocator.free(blocks)


class Subscriber:
    """A router's view of the tree: a set of hashes, kept from events alone."""

    def __init__(self) -> None:
        self.hashes: set[int] = set()

    def apply(self, events: TreeEvents) -> None:
        if events.cleared:
            self.hashes.clear()
        self.hashes.difference_update(events.removed)
        self.hashes.update(events.stored)


A = list(range(1, 13))  # three pages of 4
B = A[:4] + [50, 51, 52, 53]  # shares A's first page


class TestStored:
    @pytest.mark.parametrize("page_size", [1, 4])
    def test_an_insert_stores_the_hashes_of_its_pages(self, page_size: int) -> None:
        cache = new_cache(page_size)
        put(cache, A)
        events = cache.take_events()
        assert events.stored == page_hashes(A, page_size) and not events.removed
        assert not events.cleared and not cache.take_events()  # taken: nothing pending
        assert sorted(cache.page_hashes_in_tree()) == sorted(page_hashes(A, page_size))

    def test_only_the_new_pages_of_an_insert_are_stored(self) -> None:
        cache = new_cache()
        put(cache, A)
        cache.take_events()
        put(cache, A)  # all cached already: no event
        assert not cache.take_events()
        put(cache, B)  # splits A's edge after one page, adds one page
        assert cache.take_events().stored == page_hashes(B, 4)[1:]
        assert sorted(cache.page_hashes_in_tree()) == sorted(
            set(page_hashes(A, 4)) | set(page_hashes(B, 4)))
        cache.check_invariants()

    def test_a_split_keeps_every_page_its_hash(self) -> None:
        cache = new_cache()
        put(cache, A)
        before = cache.match_prefix(A).node.hashes.tolist()
        m = cache.match_prefix(A[:8] + [99] * 4)  # ends inside the edge: splits it
        upper = m.node
        lower = next(iter(upper.children.values()))
        assert upper.hashes.tolist() + lower.hashes.tolist() == before == page_hashes(A, 4)
        cache.check_invariants()
        assert cache.take_events().stored == page_hashes(A, 4)  # the split added nothing

    def test_namespaces_hash_the_same_tokens_apart(self) -> None:
        cache = new_cache()
        put(cache, A)
        put(cache, A, namespace="tenant-a")
        put(cache, A, namespace="tenant-b")
        stored = cache.take_events().stored
        default, ns_a, ns_b = (page_hashes(A, 4, ns) for ns in (None, "tenant-a", "tenant-b"))
        assert stored == default + ns_a + ns_b
        assert len(set(stored)) == 9
        cache.check_invariants()


class TestRemovedAndCleared:
    def test_eviction_reports_the_evicted_nodes_hashes(self) -> None:
        cache = new_cache()
        put(cache, A)
        put(cache, B)
        cache.take_events()
        cache.match_prefix(A)  # B's leaf is now the least recently used
        assert cache.evict(1) == 1
        assert cache.take_events() == TreeEvents([], page_hashes(B, 4)[1:], False)
        assert cache.evict(100) == 3  # A's two leaves' pages, then their parent
        assert sorted(cache.take_events().removed) == sorted(page_hashes(A, 4))
        assert cache.page_hashes_in_tree() == []

    def test_flush_reports_cleared_and_drops_what_was_pending(self) -> None:
        cache = new_cache()
        put(cache, A)
        cache.flush()
        assert cache.take_events() == TreeEvents([], [], True)
        put(cache, A)
        cache.evict(100)
        put(cache, B)
        cache.flush()
        put(cache, A, namespace="t")
        assert cache.take_events() == TreeEvents(page_hashes(A, 4, "t"), [], True)

    def test_stored_then_evicted_before_a_take_is_still_reported_removed(self) -> None:
        """A subscriber may hold a hash from a snapshot taken in between: it must go."""
        cache = new_cache()
        put(cache, A)
        snapshot = set(cache.page_hashes_in_tree())
        cache.evict(100)
        events = cache.take_events()
        assert events.stored == [] and sorted(events.removed) == sorted(page_hashes(A, 4))
        view = Subscriber()
        view.hashes = snapshot
        view.apply(events)
        assert view.hashes == set()

    def test_evicted_then_stored_again_ends_present(self) -> None:
        cache = new_cache()
        put(cache, A)
        cache.take_events()
        cache.evict(100)
        put(cache, A)
        view = Subscriber()
        view.hashes = set(page_hashes(A, 4))
        view.apply(cache.take_events())
        assert view.hashes == set(cache.page_hashes_in_tree()) == set(page_hashes(A, 4))

    def test_a_disabled_cache_has_no_events(self) -> None:
        cache = new_cache(enabled=False)
        put(cache, A)
        cache.evict(10)
        cache.flush()
        assert not cache.take_events() and cache.page_hashes_in_tree() == []

    def test_events_are_opt_in(self) -> None:
        cache = RadixCache(BlockAllocator(8), 4)
        put(cache, A)
        assert not cache.events.changed  # nothing accumulates for a caller that never drains
        with pytest.raises(RuntimeError, match="record_events"):
            cache.take_events()


class TestInvariants:
    def test_a_wrong_hash_is_caught(self) -> None:
        cache = new_cache()
        put(cache, A)
        put(cache, B)
        node = cache.match_prefix(B).node
        node.hashes[0] ^= 1
        with pytest.raises(AssertionError, match="page hashes"):
            cache.check_invariants()

    def test_a_hash_chained_from_the_wrong_namespace_is_caught(self) -> None:
        cache = new_cache()
        put(cache, A, namespace="t")
        node = cache.match_prefix(A, namespace="t").node
        node.hashes = array("q", page_hashes(A, 4))  # the default namespace's chain
        with pytest.raises(AssertionError, match="page hashes"):
            cache.check_invariants()
