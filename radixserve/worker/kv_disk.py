"""The disk tier's bytes: one file per entry, written off the step's critical path.

The scheduler keeps the books (cache/disk.py) and says, at the start of each step, what to
save, read back and delete (`ForwardBatch.kv_store`, `kv_load`, `kv_drop`). Saving copies
the blocks out of the pool at once (they may be reused by this very step) and leaves the
file to a writer thread; a load of an entry whose file is not written yet is served from
that copy.

Crash safety: a file is written under an unpredictable temporary name (mode 0600, created
O_EXCL | O_NOFOLLOW: `disk_layout.PinnedDir.write_temp`), fsync'd, renamed into place and the
directory fsync'd, so a file that exists under its final name was complete once. Every
file starts with a header naming its entry, the page hash it holds (the tree node's key)
and its payload's length and CRC-32; a load checks all of them, so a truncated, corrupted,
missing or misnamed file, or a symbolic link, is a miss (logged, its blocks never used),
never garbage KV. Every file operation is relative to the directory as it was pinned at
start (`disk_layout.pinned`), never through its path again.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import struct
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from radixserve.disk_layout import entry_name, pinned
from radixserve.worker.kv_pool import KVPool

log = logging.getLogger(__name__)
MAGIC = b"RSKVv001"
HEADER = struct.Struct("<8sqqqII")
"""magic, entry, key (page hash), payload bytes, payload CRC-32, pages."""
class DiskStore:
    def __init__(self, directory: Path) -> None:
        self.store = pinned(directory)
        self.directory = self.store.path
        self._pending: dict[int, tuple[int, torch.Tensor]] = {}
        """Saved entries whose files are not written yet: (key, KV), for loads meanwhile."""
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[str, int]] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="radixserve-kv-disk",
                                        daemon=True)
        self._writer.start()
        self.write_errors = 0

    def save(self, entry: int, key: int, kv: torch.Tensor) -> None:
        """Write `kv` (a CPU tensor of its own: the caller's copy) as `entry`, soon."""
        with self._lock:
            self._pending[entry] = (key, kv)
        self._queue.put(("write", entry))

    def drop(self, entry: int) -> None:
        """Delete `entry`'s file (after its write, if that is still queued)."""
        with self._lock:
            self._pending.pop(entry, None)
        self._queue.put(("drop", entry))

    def load(self, entry: int, key: int, pages: int, like: torch.Tensor) -> torch.Tensor | None:
        """`entry`'s KV, shaped and typed as `like` with `pages` blocks, or None (logged)
        when its file is missing, truncated, corrupted or holds another entry."""
        with self._lock:
            pending = self._pending.get(entry)
        if pending is not None:
            return pending[1] if pending[0] == key else None
        shape = (like.shape[0], like.shape[1], pages, *like.shape[3:])
        want = like.element_size() * pages * like[:, :, :1].numel()
        name = entry_name(entry)
        payload = bytearray(want)  # read into place: the tensor is made on it, no copy
        try:
            with self.store.open_read(name) as f:
                header = f.read(HEADER.size)
                got = f.readinto(payload) if len(header) == HEADER.size else 0
                extra = len(f.read(1))
        except OSError as e:
            log.warning("disk tier: entry %d unreadable (%s): a miss", entry, e)
            return None
        problem = self._check(header, payload, got + extra, entry, key, pages)
        if problem is not None:
            log.warning("disk tier: %s %s: a miss, the file is ignored", name, problem)
            return None
        return torch.frombuffer(payload, dtype=torch.uint8).view(like.dtype).view(shape)

    @staticmethod
    def _check(header: bytes, payload: bytearray, got: int, entry: int, key: int,
               pages: int) -> str | None:
        if len(header) < HEADER.size:
            return "is truncated (no header)"
        magic, f_entry, f_key, size, crc, f_pages = HEADER.unpack(header)
        if magic != MAGIC:
            return "is not a KV file of this format"
        if (f_entry, f_key, f_pages) != (entry, key, pages) or size != len(payload):
            return "holds another entry than the one asked for"
        if got != size:
            return f"is truncated ({got} of {size} payload bytes)" if got < size else \
                "is longer than its header says"
        if zlib.crc32(payload) != crc:
            return "is corrupted (checksum mismatch)"
        return None

    def sync(self) -> None:
        """Return once every save and drop so far is on disk."""
        self._queue.join()

    def _write_loop(self) -> None:
        while True:
            op, entry = self._queue.get()
            try:
                if op == "write":
                    self._write(entry)
                else:
                    self.store.unlink(entry_name(entry))
            except OSError as e:  # a full disk: the entry is a miss later, serving goes on
                self.write_errors += 1
                log.warning("disk tier: %s of entry %d failed: %s", op, entry, e)
            finally:
                self._queue.task_done()

    def _write(self, entry: int) -> None:
        with self._lock:
            pending = self._pending.get(entry)
        if pending is None:  # dropped before it was written
            return
        key, kv = pending
        payload = kv.contiguous().view(torch.uint8).numpy().data.cast("B")
        header = HEADER.pack(MAGIC, entry, key, payload.nbytes, zlib.crc32(payload),
                             kv.shape[2])
        name = entry_name(entry)
        tmp = self.store.write_temp(name, header, payload)
        with self._lock:
            if self._pending.get(entry) is not pending:  # dropped while being written
                self.store.unlink(tmp)
                return
            self.store.replace(tmp, name)
            del self._pending[entry]
        self.store.fsync()  # the rename itself survives a crash


def model_fingerprint(model_dir: Path, dtype: torch.dtype, page_size: int) -> str:
    """Names the KV a model computes: its config, its weights (each file's name, size and
    first and last MiB: a retrained or requantized model differs there without reading
    gigabytes at every start), the dtype and the page size."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"radixserve-kv:{dtype}:{page_size}\0".encode())
    h.update((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        size = path.stat().st_size
        h.update(f"\0{path.name}:{size}\0".encode())
        with open(path, "rb") as f:
            h.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read(1 << 20))
    return h.hexdigest()


def measure_costs(disk: DiskStore, pool: KVPool, prefill: Callable[[int], object]
                  ) -> tuple[float, float]:
    """What a token costs to prefill (`prefill(n)` runs a prefill of n tokens into the
    first blocks) and to load back from `disk`, in seconds: which decides whether a
    prefix on disk is read or recomputed. Writes only the first blocks, which hold
    nothing yet; every rank measures in its own start-up (these steps are not shared)."""
    page = pool.page_size
    n = min(128, page * pool.num_blocks) // page * page
    if n == 0:
        return 0.0, 0.0
    prefill(min(8, n))
    start = time.perf_counter()
    prefill(n)
    prefill_cost = (time.perf_counter() - start) / n
    blocks = list(range(n // page))
    disk.save(0, 0, pool.read_blocks(blocks))  # entry 0: never the tree's
    disk.sync()
    start = time.perf_counter()
    kv = disk.load(0, 0, len(blocks), pool.buffer)
    if kv is None:
        raise RuntimeError(f"the disk tier cannot read back what it writes in {disk.directory}")
    pool.write_blocks(blocks, kv)
    load_cost = (time.perf_counter() - start) / n
    disk.drop(0)
    disk.sync()
    log.info("disk tier: a token costs %.3g ms to prefill, %.3g ms to load from %s",
                prefill_cost * 1e3, load_cost * 1e3, disk.directory)
    return prefill_cost, load_cost
