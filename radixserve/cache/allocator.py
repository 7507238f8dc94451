"""Physical KV-block allocator: a free list plus one reference count per block.

Why reference counts and not only a free list: a block can be held by the radix tree and,
through copy-on-write forks, by several sequences at once. It may go back to the free list
only when its last holder lets go, never before; a block on the free list while something
still reads it is silent KV corruption, so every misuse here raises instead.
"""

from __future__ import annotations

from collections.abc import Iterable


class AllocatorError(RuntimeError):
    """A block was freed or referenced while free: a bookkeeping bug in the caller."""


class BlockAllocator:
    """Hands out block ids `0 .. num_blocks-1`; each allocated block has a refcount >= 1.

    Hot paths are plain loops over a `list[int]` of refcounts and a `list[int]` free stack:
    alloc/free of n blocks is O(n) with small constants and no per-block objects.
    """

    __slots__ = ("_num_blocks", "_refcount", "_free")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self._num_blocks = num_blocks
        self._refcount: list[int] = [0] * num_blocks
        # A stack: alloc takes slices from the end (O(1) amortised per block). Filled in
        # reverse so a fresh allocator hands out 0, 1, 2, ..., which keeps test output and
        # debug dumps readable.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._num_blocks - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """`n` blocks, each with refcount 1, in ascending order; None (allocating nothing)
        if fewer are free. Ascending, so that blocks freed together (a finished sequence's,
        pushed in its table's order) are handed out again as runs of consecutive ids,
        which the virtual KV layout maps as one memory mapping each.

        All-or-nothing so a caller never has to undo half an allocation: on None it can
        evict from the tree or retract a request, then try again.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        free = self._free
        if n > len(free):
            return None
        if n == 0:
            return []
        blocks = free[-n:]
        del free[-n:]
        blocks.sort()
        rc = self._refcount
        for b in blocks:
            rc[b] = 1
        return blocks

    def incref(self, blocks: Iterable[int]) -> None:
        """Add a holder to each (allocated) block, e.g. a forked sequence sharing it."""
        rc = self._refcount
        n = self._num_blocks
        for b in blocks:
            if not 0 <= b < n:
                raise IndexError(f"block {b} out of range [0, {n})")
            if rc[b] <= 0:
                # Reviving a block that sits on the free list would let alloc hand it out
                # to a second owner.
                raise AllocatorError(f"incref of free block {b}")
            rc[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one holder of each block; a block whose count reaches 0 becomes free.

        Freeing a free block raises `AllocatorError` (double free is a bug: fail loudly).
        Blocks processed before the bad one stay released, so after a raise the caller's
        bookkeeping is already broken; the error is for finding the bug, not recovering.
        """
        rc = self._refcount
        free = self._free
        n = self._num_blocks
        for b in blocks:
            if not 0 <= b < n:
                raise IndexError(f"block {b} out of range [0, {n})")
            c = rc[b]
            if c <= 0:
                raise AllocatorError(f"double free of block {b}")
            rc[b] = c - 1
            if c == 1:
                free.append(b)

    def refcount(self, block: int) -> int:
        if not 0 <= block < self._num_blocks:
            raise IndexError(f"block {block} out of range [0, {self._num_blocks})")
        return self._refcount[block]

    def check_holders(self, holders: Iterable[Iterable[int]]) -> None:
        """Debug: each block's count must equal the number of times `holders` (every block
        list that owns references: the tree's, each sequence's table) name it, and exactly
        the blocks nobody holds must be free. Raises AssertionError naming the first bad
        block."""
        counts = [0] * self._num_blocks
        for blocks in holders:
            for b in blocks:
                counts[b] += 1
        for b, (held, rc) in enumerate(zip(counts, self._refcount)):
            assert held == rc, f"block {b}: refcount {rc} but {held} holder(s)"
        free = self._free
        assert len(free) == len(set(free)), "a block is on the free list twice"
        assert sorted(free) == [b for b, c in enumerate(counts) if c == 0], \
            "the free list is not exactly the blocks nobody holds"

    def __repr__(self) -> str:
        return f"BlockAllocator(num_blocks={self._num_blocks}, num_free={self.num_free})"
