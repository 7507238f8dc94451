"""The ranks of one host summing and gathering through shared memory: what gloo's TCP
collectives cost a CPU step (0.5-1 ms an all-reduce on loopback, 2 per layer; the logits'
gather at gloo's loopback rate), at the price of a memory copy.

One segment in /dev/shm, mapped by every rank: per rank a sequence flag and a slot. A call
copies the rank's tensor into its slot and publishes the call's sequence number in its
flag. An all-reduce then waits until every rank's flag has it and adds the slots in rank
order, so every rank computes the same sum, bit for bit; a gather has rank 0 alone wait
and read them. Two sets of slots alternate between calls: before a rank writes set `p`
again, two calls later, it waits until every rank has published the call in between,
which each does only once it has read set `p`.

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


class ShmCollectives:
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
        """`t` summed over the ranks, in place (every rank calls each collective here, in
        the same order)."""
        slots = self._publish(t)
        t.copy_(slots[0])
        for slot in slots[1:]:
            t.add_(slot)
        return t

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Rank 0: every rank's `t` (views of the slots, valid until the next call);
        the others: None, at once."""
        slots = self._publish(t, wait=self.rank == 0)
        return slots if self.rank == 0 else None

    def _publish(self, t: torch.Tensor, wait: bool = True) -> list[torch.Tensor]:
        """Put `t` in this rank's slot of the call's set and say so; with `wait`, until
        every rank has. The set's slots, shaped as `t`."""
        self.seq += 1
        parity = self.seq % 2
        # The set was last read in call seq - 2; every rank that has published seq - 1 is
        # done with it (after an all-reduce they all have: this returns at once).
        self._wait(self.flags[1 - parity], self.seq - 1)
        slots = [s[:t.nbytes].view(t.dtype).view(t.shape) for s in self.slots[parity]]
        slots[self.rank].copy_(t)
        self.flags[parity, self.rank] = self.seq
        if wait:
            self._wait(self.flags[parity], self.seq)
        return slots

    def _wait(self, flags: torch.Tensor, seq: int) -> None:
        """Until every rank's flag in `flags` has reached `seq`."""
        checked = time.monotonic()
        while bool((flags < seq).any()):
            os.sched_yield()
            if time.monotonic() - checked > LIVENESS_EVERY:
                self._check_alive(flags, seq)
                checked = time.monotonic()

    def _check_alive(self, flags: torch.Tensor, seq: int) -> None:
        for r, pid in enumerate(self.pids):
            if int(flags[r]) < seq and not _alive(pid):
                raise RuntimeError(f"tensor-parallel rank {r} (pid {pid}) died")


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
