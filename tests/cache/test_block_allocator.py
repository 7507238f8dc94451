"""BlockAllocator: all-or-nothing alloc, refcounts, and loud failure on misuse."""

from __future__ import annotations

import pytest

from radixserve.cache import AllocatorError, BlockAllocator
from radixserve.cache.allocator import GROWTH_RUN


class TestAlloc:
    def test_fresh_allocator_hands_out_distinct_blocks_with_refcount_one(self) -> None:
        a = BlockAllocator(8)
        blocks = a.alloc(3)
        assert blocks == [0, 1, 2]
        assert a.num_free == 5 and a.peak_used == 3 and a.num_blocks == 8
        assert all(a.refcount(b) == 1 for b in blocks)
        more = a.alloc(5)
        assert more is not None and not set(more) & set(blocks)
        assert a.num_free == 0

    def test_blocks_freed_together_come_back_as_one_run(self) -> None:
        # A finished sequence's table, freed in its order, is handed out again as
        # consecutive ids (one memory mapping in the virtual KV layout), not reversed.
        a = BlockAllocator(16)
        first, second = a.alloc(6), a.alloc(4)
        a.free(first)
        assert a.alloc(6) == first == list(range(6))
        a.free(reversed(second))
        assert a.alloc(4) == second

    def test_tables_growing_side_by_side_stay_runs(self) -> None:
        # Three prompts, then their decodes taking a block each in turn: with `after`, each
        # table continues in the blocks set aside after its last one, a run of GROWTH_RUN
        # at a time, instead of the three interleaving block by block.
        a = BlockAllocator(128)
        tables = [a.alloc(2) for _ in range(3)]
        for _ in range(2 * GROWTH_RUN):
            for t in tables:
                t += a.alloc(1, after=t[-1])
        runs = [sum(y != x + 1 for x, y in zip(t, t[1:])) + 1 for t in tables]
        assert runs == [3, 3, 3]  # the prompt's run, then two growth runs each
        a.check_holders(tables)
        # One more block each starts a third run, with GROWTH_RUN - 1 blocks set aside
        # after it. Plain allocations leave those to the tables while the stack has
        # blocks...
        for t in tables:
            t += a.alloc(1, after=t[-1])
        plain = a.alloc(a.num_free - 3 * (GROWTH_RUN - 1))
        assert plain is not None and not set(plain) & {t[-1] + 1 for t in tables}
        assert all(a.alloc(1, after=t[-1]) == [t[-1] + 1] for t in tables)
        # ...and take them once it has none: every free block is still free for anyone.
        assert a.alloc(a.num_free) is not None and a.num_free == 0
        assert a.alloc(1, after=tables[0][-1]) is None

    def test_growth_takes_the_next_free_blocks_first(self) -> None:
        a = BlockAllocator(16)
        first = a.alloc(4)
        assert a.alloc(3, after=first[-1]) == [4, 5, 6]
        a.free([first[0]])
        # Block 7 onwards are set aside for this table; block 0 is the stack's.
        assert a.alloc(1) == [0]
        assert a.alloc(2, after=6) == [7, 8]
        a.check_holders([first, [4, 5, 6], [7, 8]])

    def test_too_many_returns_none_and_allocates_nothing(self) -> None:
        a = BlockAllocator(4)
        assert a.alloc(3) is not None
        assert a.alloc(2) is None
        assert a.num_free == 1

    def test_zero_and_negative(self) -> None:
        a = BlockAllocator(2)
        assert a.alloc(0) == []
        with pytest.raises(ValueError):
            a.alloc(-1)
        with pytest.raises(ValueError):
            BlockAllocator(-1)


class TestRefcounts:
    def test_block_returns_to_free_list_only_at_zero(self) -> None:
        a = BlockAllocator(4)
        (b,) = a.alloc(1) or []
        a.incref([b])
        a.incref([b])
        assert a.refcount(b) == 3
        a.free([b])
        a.free([b])
        assert a.refcount(b) == 1 and a.num_free == 3
        a.free([b])
        assert a.refcount(b) == 0 and a.num_free == 4

    def test_freed_blocks_are_reused(self) -> None:
        a = BlockAllocator(2)
        blocks = a.alloc(2) or []
        a.free(blocks)
        assert sorted(a.alloc(2) or []) == [0, 1]


class TestMisuse:
    def test_double_free_raises(self) -> None:
        a = BlockAllocator(4)
        blocks = a.alloc(2) or []
        a.free(blocks)
        with pytest.raises(AllocatorError, match="double free"):
            a.free(blocks[:1])

    def test_same_block_twice_in_one_free_raises(self) -> None:
        a = BlockAllocator(4)
        (b,) = a.alloc(1) or []
        with pytest.raises(AllocatorError):
            a.free([b, b])

    def test_free_of_never_allocated_block_raises(self) -> None:
        with pytest.raises(AllocatorError):
            BlockAllocator(4).free([3])

    def test_incref_of_free_block_raises(self) -> None:
        with pytest.raises(AllocatorError):
            BlockAllocator(4).incref([0])

    @pytest.mark.parametrize("block", [-1, 4])
    def test_out_of_range_raises(self, block: int) -> None:
        a = BlockAllocator(4)
        a.alloc(4)
        for op in (a.free, a.incref):
            with pytest.raises(IndexError):
                op([block])
        with pytest.raises(IndexError):
            a.refcount(block)
