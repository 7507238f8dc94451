"""The disk tier's loads in flight: prefixes on their way back from disk, and the holds on
those that came back.

A waiting sequence whose cached prefix goes on into nodes on disk (and for which reading
them beats recomputing, as the worker measured at start-up) gets blocks for them and
waits, holding no blocks of its own, while the next step reads them in
(`KVManager.start_load` asks; `take` gives the step its loads, `finish` folds in what it
read); it is then admitted like any other, its prefix in memory. Until it is admitted, the
loaded prefix stays locked for it (its "hold"), so the growth of running requests and
other admissions cannot send it straight back to disk; a scheduler that runs out of memory
for its running requests drops the holds (`drop_holds`) before it retracts any of them.
"""

from __future__ import annotations

from collections.abc import Iterable

from radixserve.cache.allocator import BlockAllocator
from radixserve.cache.radix import RadixCache
from radixserve.scheduler.kv_handle import KVHandle, PrefixLoad


class DiskLoads:
    def __init__(self, allocator: BlockAllocator, tree: RadixCache) -> None:
        self.allocator, self.tree = allocator, tree
        self.asked: list[PrefixLoad] = []
        """Loads asked for since the last `take`: the next step carries them."""
        self.reading: list[PrefixLoad] = []
        """Loads taken by a step not folded yet (with overlap scheduling, one in flight)."""
        self.held: list[PrefixLoad] = []
        """Loads done whose prefixes are held for their sequences (`drop_hold` ends it)."""

    def blocks(self) -> list[int]:
        """The blocks of the loads asked for or being read (their holders)."""
        return [b for load in self.asked + self.reading for b in load.blocks]

    def take(self) -> list[PrefixLoad]:
        loads, self.asked = self.asked, []
        self.reading += loads
        return loads

    def finish(self, loads: list[PrefixLoad], failed: Iterable[int] | None) -> None:
        """The step that carried `loads` ran: their nodes are in memory again, held for
        their sequences, but for the entries in `failed` (dropped from the tree with what
        lies below them: misses from now on). `failed` None: the step never ran, so nothing
        was read (the nodes stay on disk)."""
        bad = set(failed or ())
        tree = self.tree
        for load in loads:
            self.reading.remove(load)
            tree.unlock(load.match.nodes[-1])
            ok, start, loaded, hold = failed is not None, 0, 0, None
            for node, entry in zip(load.match.nodes, load.entries):
                pages = len(node.hashes)
                blocks = load.blocks[start:start + pages]
                start += pages
                if ok and entry in bad:
                    tree.fail_load(node)
                    ok = False
                if ok:
                    if tree.finish_load(node, blocks):
                        loaded += len(node.tokens)
                    else:
                        self.allocator.free(blocks)
                    hold = node
                else:
                    self.allocator.free(blocks)
            h = load.handle
            h.disk_tokens = max(h.disk_tokens, min(loaded, load.match.length))
            if hold is not None and h.loading is load:
                tree.lock(hold)
                load.hold = hold
                self.held.append(load)
            elif h.loading is load:
                h.loading = None

    def drop_hold(self, h: KVHandle) -> None:
        """End `h`'s hold on its loaded prefix, if it has one (see the module docstring)."""
        load = h.loading
        if load is not None and load.hold is not None:
            self.tree.unlock(load.hold)
            h.loading = None
            self.held.remove(load)

    def drop_holds(self) -> None:
        """End every hold (memory is short for the running requests)."""
        for load in list(self.held):
            self.drop_hold(load.handle)
