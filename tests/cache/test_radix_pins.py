"""RadixCache pins, hits and the summary, with integers: a pin is a lock eviction skips,
counted per node so flush and the invariants tell pins from requests' locks; splits keep
pins and hits; the summary picks the largest and hottest nodes with their ancestors."""

from __future__ import annotations

import pytest

from tests.cache.test_radix_cache import assert_accounted, new_cache, put


class TestPin:
    def test_eviction_skips_a_pinned_prefix(self) -> None:
        alloc, cache = new_cache(page_size=2, num_blocks=16)
        pinned = put(cache, [1, 2, 3, 4, 5, 6])
        cache.pin(pinned.node)
        put(cache, [9, 9, 8, 8])
        assert cache.pinned_tokens == 6 and cache.locked_blocks == 3
        assert cache.evict(100) == 2  # only the unpinned prefix goes
        assert cache.match_prefix([1, 2, 3, 4, 5, 6]).length == 6
        assert_accounted(alloc, cache)
        cache.unpin(pinned.node)
        assert cache.pinned_tokens == 0 and cache.evict(100) == 3
        assert_accounted(alloc, cache)

    def test_split_keeps_the_pin_on_both_parts(self) -> None:
        alloc, cache = new_cache()
        node = put(cache, [1, 2, 3, 4]).node
        cache.pin(node)
        cache.match_prefix([1, 2, 7])  # splits the pinned edge after two tokens
        assert cache.num_nodes == 2 and cache.pinned_tokens == 4
        assert_accounted(alloc, cache)
        cache.unpin(node)
        assert cache.pinned_tokens == 0
        assert_accounted(alloc, cache)

    def test_overlapping_pins_count_shared_tokens_once(self) -> None:
        alloc, cache = new_cache()
        long = put(cache, [1, 2, 3, 4, 5]).node
        short = cache.match_prefix([1, 2, 3]).node
        assert cache.unpinned_tokens(long) == 5
        cache.pin(short)
        assert cache.unpinned_tokens(long) == 2
        cache.pin(long)
        assert cache.pinned_tokens == 5
        cache.unpin(short)
        assert cache.pinned_tokens == 5  # still under the long pin
        cache.unpin(long)
        with pytest.raises(RuntimeError, match="unpin of unpinned"):
            cache.unpin(long)
        assert_accounted(alloc, cache)

    def test_flush_keeps_pins_and_refuses_request_locks(self) -> None:
        alloc, cache = new_cache()
        node = put(cache, [1, 2, 3]).node
        other = put(cache, [1, 2, 9, 9]).node
        cache.pin(node)
        cache.lock(other)
        with pytest.raises(RuntimeError, match="requests still running"):
            cache.flush()
        cache.unlock(other)
        cache.flush()
        assert cache.cached_tokens == 3 and alloc.num_free == alloc.num_blocks - 3
        assert_accounted(alloc, cache)
        cache.unpin(node)
        cache.flush()
        assert alloc.num_free == alloc.num_blocks
        assert_accounted(alloc, cache)

    def test_invariants_catch_a_pin_without_its_lock(self) -> None:
        _, cache = new_cache()
        node = put(cache, [1, 2]).node
        node.pin_count = 1  # a pin the lock count does not know of
        with pytest.raises(AssertionError, match="pin count"):
            cache.check_invariants()


class TestSummary:
    def test_largest_and_hottest_with_ancestors_in_tree_order(self) -> None:
        _, cache = new_cache()
        put(cache, [1, 2, 3, 4, 5, 6])
        put(cache, [1, 2, 3, 7])
        hot = put(cache, [8, 9]).node
        for _ in range(3):
            cache.record_lookup(hot, 0, 0)
        summary = cache.summary(1, lambda ns: True)
        nodes = summary["nodes"]
        by_id = {n["id"]: n for n in nodes}
        assert [n["head_ids"] for n in nodes if n["parent"] is None] in (
            [[1, 2, 3], [8, 9]], [[8, 9], [1, 2, 3]])
        deepest = max(nodes, key=lambda n: n["prefix_tokens"])
        assert deepest["head_ids"] == [1, 2, 3, 4, 5, 6] and deepest["edge_ids"] == [4, 5, 6]
        assert by_id[deepest["parent"]]["depth"] == deepest["depth"] - 1
        assert by_id[hot.id]["hits"] == 3 and all(n["tier"] == "memory" for n in nodes)
        assert len(nodes) == 3  # the [7] leaf is neither largest nor hottest
        assert summary["totals"]["memory"] == {"nodes": 4, "tokens": 9, "pinned_tokens": 0,
                                               "hits": 3}

    def test_namespaces_not_visible_are_left_out(self) -> None:
        alloc, cache = new_cache()
        for ns in ("ns-a", "ns-b"):
            blocks = alloc.alloc(2)
            cache.insert([1, 2], blocks, namespace=ns)
            alloc.free(blocks)
        summary = cache.summary(10, lambda ns: ns == "ns-a")
        assert [n["namespace"] for n in summary["nodes"]] == ["ns-a"]
        assert summary["totals"]["memory"]["tokens"] == 2
