"""Physical KV-block allocator: a free list plus one reference count per block.

Why reference counts and not only a free list: a block can be held by the radix tree and,
through copy-on-write forks, by several sequences at once. It may go back to the free list
only when its last holder lets go, never before; a block on the free list while something
still reads it is silent KV corruption, so every misuse here raises instead.
"""

from __future__ import annotations

from collections.abc import Iterable

GROWTH_RUN = 8
"""Blocks a growing table keeps set aside after its last one (`alloc`'s `after`)."""


class AllocatorError(RuntimeError):
    """A block was freed or referenced while free: a bookkeeping bug in the caller."""


class BlockAllocator:
    """Hands out block ids `0 .. num_blocks-1`; each allocated block has a refcount >= 1.

    Free blocks are on one of two lists: the free stack, which plain allocations take
    from, and the spares a growing table keeps after its last block (`alloc`'s `after`),
    which plain allocations take only once the stack is empty. Both count as free.

    Hot paths are plain loops over `list[int]`s (refcounts, the free stack, each free
    block's place in it) and a dict of spares: alloc/free of n blocks is O(n) with small
    constants and no per-block objects.
    """

    __slots__ = ("_num_blocks", "_refcount", "_free", "_at", "_spare", "num_free", "peak_used")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self._num_blocks = num_blocks
        self._refcount: list[int] = [0] * num_blocks
        # A stack: alloc takes slices from the end (O(1) amortised per block). Filled in
        # reverse so a fresh allocator hands out 0, 1, 2, ..., which keeps test output and
        # debug dumps readable.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._at: list[int] = list(range(num_blocks - 1, -1, -1))
        """Each block's index in the free stack, -1 where it is not there."""
        self._spare: dict[int, None] = {}
        """Free blocks set aside after a growing table's last block."""
        self.num_free = num_blocks
        """Blocks on either free list (kept as they change: read on every step's path)."""
        self.peak_used = 0
        """Most blocks allocated at once so far."""

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def alloc(self, n: int, after: int | None = None) -> list[int] | None:
        """`n` blocks, each with refcount 1; None (allocating nothing) if fewer are free.

        Without `after`: in ascending order, so that blocks freed together (a finished
        sequence's, pushed in its table's order) are handed out again as runs of
        consecutive ids, which the virtual KV layout maps as one memory mapping each.
        `after`: the last block of the table they extend; the blocks that follow it come
        first where they are free, and the `GROWTH_RUN - 1` free blocks that follow the
        last one handed out are set aside for the table's next growth. So tables growing
        side by side (decodes, chunked prefills) stay runs instead of interleaving.

        All-or-nothing so a caller never has to undo half an allocation: on None it can
        evict from the tree or retract a request, then try again.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            return None
        rc, blocks = self._refcount, list[int]()
        if after is not None:
            b = after + 1
            while len(blocks) < n and b < self._num_blocks and rc[b] == 0:
                self._take(b)
                blocks.append(b)
                b += 1
        rest = n - len(blocks)
        if rest:
            free = self._free
            top = free[-rest:] if rest <= len(free) else free[:]
            del free[len(free) - len(top):]
            for b in top:
                self._at[b] = -1
            spare = self._spare
            while len(top) < rest:
                top.append(spare.popitem()[0])
            blocks += sorted(top)
        for b in blocks:
            rc[b] = 1
        self.num_free -= n
        self.peak_used = max(self.peak_used, self._num_blocks - self.num_free)
        if after is not None and blocks:
            end = blocks[-1]
            for b in range(end + 1, min(end + GROWTH_RUN, self._num_blocks)):
                if self._at[b] < 0:
                    break
                self._take(b)
                self._spare[b] = None
        return blocks

    def _take(self, b: int) -> None:
        """Take free block `b` off its list (the stack: the top fills its place)."""
        if b in self._spare:
            del self._spare[b]
            return
        free, at = self._free, self._at
        i, top = at[b], free.pop()
        if top != b:
            free[i], at[top] = top, i
        at[b] = -1

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
                self._at[b] = len(free)
                free.append(b)
                self.num_free += 1

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
        free = self._free + list(self._spare)
        assert len(free) == len(set(free)), "a block is on the free list twice"
        assert self.num_free == len(free), f"num_free {self.num_free}, {len(free)} free"
        assert sorted(free) == [b for b, c in enumerate(counts) if c == 0], \
            "the free list is not exactly the blocks nobody holds"
        assert all(self._at[b] == i for i, b in enumerate(self._free)), \
            "the free stack's index is stale"

    def __repr__(self) -> str:
        return f"BlockAllocator(num_blocks={self._num_blocks}, num_free={self.num_free})"
