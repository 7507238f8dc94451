"""A sum over the ranks of one host through shared memory: what gloo's TCP all-reduce costs
a CPU step (0.5-1 ms a call on loopback; 2 per layer), at the price of a memory copy and
an add.

One segment in /dev/shm, mapped by every rank: per rank a sequence flag and a slot for its
partial. An all-reduce copies the rank's partial into its slot, publishes the call's
sequence number in its flag, waits until every rank's flag has it, then adds the slots in
rank order, so every rank computes the same sum, bit for bit. Two sets of slots alternate
between calls: a rank writes set `p` again only two calls later, after every rank has
published the call in between, which each does only once it has read set `p`.

The protocol relies on x86's ordering of stores (a flag is seen only after the data
written before it): `available()` says where it runs. A rank that waits checks now and
then that the others are alive, so a dead rank fails the call instead of hanging it.
"""

from __future__ import annotations

import os
import platform
import time
import uuid
from pathlib import Path

import torch

SLOT_BYTES = 8 * 1024 * 1024
"""Largest partial a call takes here (a 2k-token chunk of a 1k-wide model in fp32); a
larger one goes through gloo."""
LIVENESS_EVERY = 0.05
"""Seconds between two checks, while waiting, that the other ranks are alive."""


def available() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and Path("/dev/shm").is_dir()


class ShmAllReduce:
    """Rank `rank` of `world` on one host. Rank 0 creates the segment at `path`
    (`new_path()`), the others open it once it exists, and it is unlinked once every rank
    has it open (the caller orders both); the caller then sets `pids`, every rank's
    process, for the liveness checks."""

    def __init__(self, rank: int, world: int, path: str, create: bool) -> None:
        self.rank, self.world, self.path = rank, world, path
        flag_bytes = 4096  # the flags on a page of their own
        size = flag_bytes + 2 * world * SLOT_BYTES
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, size)
            os.close(fd)
        raw = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        self.flags = raw[:flag_bytes].view(torch.int64)[:2 * world].view(2, world)
        self.slots = raw[flag_bytes:].view(2, world, SLOT_BYTES)
        self.seq = 0
        self.pids: list[int] = []

    @staticmethod
    def new_path() -> str:
        return f"/dev/shm/radixserve-tp-{uuid.uuid4().hex}"

    def unlink(self) -> None:
        Path(self.path).unlink(missing_ok=True)

    def fits(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.is_contiguous() and t.nbytes <= SLOT_BYTES

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the ranks, in place (every rank calls it, in the same order)."""
        self.seq += 1
        parity = self.seq % 2
        slots = [s[:t.nbytes].view(t.dtype).view(t.shape) for s in self.slots[parity]]
        slots[self.rank].copy_(t)
        self.flags[parity, self.rank] = self.seq
        self._wait(self.flags[parity])
        t.copy_(slots[0])
        for slot in slots[1:]:
            t.add_(slot)
        return t

    def _wait(self, flags: torch.Tensor) -> None:
        checked = time.monotonic()
        while bool((flags < self.seq).any()):
            os.sched_yield()
            if time.monotonic() - checked > LIVENESS_EVERY:
                self._check_alive(flags)
                checked = time.monotonic()

    def _check_alive(self, flags: torch.Tensor) -> None:
        for r, pid in enumerate(self.pids):
            if int(flags[r]) < self.seq and not _alive(pid):
                raise RuntimeError(f"tensor-parallel rank {r} (pid {pid}) died")


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
