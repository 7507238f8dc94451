"""The disk tier as the radix tree sees it: which entries the disk store holds, their size,
the room left, and what the worker must do to the store before its next step.

The tree moves a node's KV here when it evicts the node from memory (`RadixCache.evict`)
and back when a match reaches it (`RadixCache.match_disk`, `finish_load`). This class only
keeps the books: the bytes live in the worker's `worker/kv_disk.py` store, which carries out
the queued transfers in the order stores, loads, drops at the start of the next step. That
order is what makes a store safe: the blocks of a node just evicted are free in the
allocator and may be handed out in the same schedule, but nothing writes them before the
step, and the step saves them first. No torch, no file IO here.

Every entry belongs to exactly one tree node (`entries` and the nodes' ``disk_id`` are the
same set, which `check_radix_invariants` recounts), and ids are never reused, so a file name
names one edge's KV for the life of the store, across restarts.
"""

from __future__ import annotations

from radixserve.messages import ForwardBatch, KVTransfer


class DiskTier:
    def __init__(self, capacity_bytes: int, bytes_per_block: int, next_id: int = 1) -> None:
        if capacity_bytes < 0 or bytes_per_block <= 0:
            raise ValueError("the disk tier needs capacity_bytes >= 0 and bytes_per_block > 0")
        self.capacity_bytes, self.bytes_per_block = capacity_bytes, bytes_per_block
        self.next_id = next_id
        self.entries: dict[int, int] = {}
        """Pages of each entry, by id."""
        self.used_bytes = 0
        self.stores: list[KVTransfer] = []
        self.loads: list[KVTransfer] = []
        self.drops: list[int] = []
        self.counters = dict(disk_stores=0, disk_loads=0, disk_load_failures=0, disk_drops=0,
                             disk_stored_tokens=0, disk_loaded_tokens=0)

    def fits(self, pages: int) -> bool:
        """Whether an entry of `pages` fits once enough others are dropped."""
        return pages * self.bytes_per_block <= self.capacity_bytes

    def over(self, pages: int) -> int:
        """Bytes to drop before an entry of `pages` fits (<= 0: it fits now)."""
        return self.used_bytes + pages * self.bytes_per_block - self.capacity_bytes

    def store(self, blocks: list[int], key: int, page_size: int) -> int:
        """A new entry for the KV in `blocks` (saved by the next step); its id. `key`, the
        page hash of the edge's last page, is written with it and checked on load."""
        entry = self.next_id
        self.next_id += 1
        self.adopt(entry, len(blocks))
        self.stores.append(KVTransfer(entry, key, list(blocks)))
        self.counters["disk_stores"] += 1
        self.counters["disk_stored_tokens"] += len(blocks) * page_size
        return entry

    def adopt(self, entry: int, pages: int) -> None:
        """Count an entry that is already on disk (a restart's index)."""
        self.entries[entry] = pages
        self.used_bytes += pages * self.bytes_per_block
        self.next_id = max(self.next_id, entry + 1)

    def load(self, entry: int, key: int, blocks: list[int]) -> None:
        """Ask the next step to read `entry` into `blocks` (checked against `key`)."""
        self.loads.append(KVTransfer(entry, key, list(blocks)))

    def drop(self, entry: int) -> None:
        """Forget `entry`; the next step deletes its file."""
        self.used_bytes -= self.entries.pop(entry) * self.bytes_per_block
        self.drops.append(entry)
        self.counters["disk_drops"] += 1

    @property
    def has_transfers(self) -> bool:
        return bool(self.stores or self.loads or self.drops)

    def take_transfers(self) -> tuple[list[KVTransfer], list[KVTransfer], list[int]]:
        ops = self.stores, self.loads, self.drops
        self.stores, self.loads, self.drops = [], [], []
        return ops

    def send_with(self, batch: ForwardBatch) -> ForwardBatch:
        """`batch` carrying every transfer queued so far (taken): the worker runs them first."""
        batch.kv_store, batch.kv_load, batch.kv_drop = self.take_transfers()
        return batch

    def stats(self) -> dict[str, int]:
        return {**self.counters, "disk_entries": len(self.entries),
                "disk_used_bytes": self.used_bytes, "disk_capacity_bytes": self.capacity_bytes}
