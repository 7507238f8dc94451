"""Tensor parallelism: this process's place in a group of worker ranks, each holding one
shard of every layer (Megatron-style: `model/linear.py`'s `ShardSpec`), over
torch.distributed (gloo for CPU tensors and for the steps themselves, NCCL for CUDA ones).

Rank 0 is the worker the scheduler talks to. It hands each step (or a control call every
rank runs) to the other ranks as a broadcast of its msgspec encoding, then runs its own
shard; the others run theirs in `Worker.follow`, and rank 0 alone samples and answers.
Every rank runs the same calls in the same order, so their collectives meet: the two
all-reduces a layer (`o_proj`, `down_proj`), the embedding's all-reduce and the gather of
the logits. What a rank does at start-up on its own (warm-up, the disk tier's measurement)
it does in every rank alike.

A rank that dies closes its connections: the others' next collective fails, and the
processes around them treat that as a worker crash (all ranks restarted). A rank that
hangs is the scheduler's watchdog's (`watchdog_timeout`).
"""

from __future__ import annotations

import os
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator

import msgspec
import torch

from radixserve.messages import WorkerInput, decode
from radixserve.worker import shm_collectives

MAX_STEP_BYTES = 256 * 1024 * 1024
"""Largest encoded step a rank accepts from rank 0 (a 512-token chunk encodes to a few
kB; a batch of 128 long block tables to a few MB)."""
START_TIMEOUT = timedelta(seconds=120)
"""How long the ranks wait for each other to meet (they meet before loading weights, once
their imports are done): a rank that failed to start fails the others' start-up after
this."""
IDLE_TIMEOUT = timedelta(days=365)
"""How long a collective may wait. A rank between steps waits in the next step's
broadcast for as long as the server is idle, so there is no useful bound here: a dead rank
fails its peers' collectives at once (its connections close), and a hung one is the
scheduler's watchdog's."""


@dataclass(frozen=True)
class Placement:
    """Where a rank runs: its rank in the group, the group's size, and how many ranks share
    its host (which divides the host's cores and names its CUDA device)."""

    rank: int = 0
    world: int = 1
    local_world: int = 1

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_world


def rendezvous(dist_init_addr: str | None, private_dir: str) -> str:
    """Where a group meets (torch's `init_method`): node 0's `host:port` when the group
    spans hosts; on one host, a new file in `private_dir` (a directory only this user
    reads), so that no port is opened for it (torch's TCP store listens on every
    interface)."""
    if dist_init_addr is not None:
        return f"tcp://{dist_init_addr}"
    return f"file://{os.path.join(private_dir, f'tp-{uuid.uuid4().hex}')}"


class TPGroup:
    """The collectives one rank's layers and worker call (the layers through
    model/protocols.py's `Collectives`). With one rank (`TPGroup()`) each is the identity,
    and the model keeps no group at all (`DecoderModel`), so its steps call none.

    The group is its own process-group objects over its own store, not torch's global
    default group, so that a process may hold several (two sharded Engines side by side)
    and a closed one leaves nothing behind: gloo for the steps and CPU tensors, NCCL for
    CUDA ones."""

    def __init__(self, placement: Placement = Placement(), init_method: str | None = None,
                 device: torch.device = torch.device("cpu"), shm: bool = True) -> None:
        """`shm`: on one host, sum and gather CPU tensors through shared memory
        (`shm_collectives.py`) rather than gloo, where it runs."""
        self.rank, self.world = placement.rank, placement.world
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(WorkerInput)
        self.broken: str | None = None
        """Why the group is unusable: a shared call failed part-way on this rank."""
        if self.world == 1:
            return
        import torch.distributed as dist

        if init_method is None:
            raise ValueError("a tensor-parallel group of more than one rank needs a place "
                             "to meet (`rendezvous`)")
        self._dist = dist
        self._store = store = self._meet(init_method)  # kept: the TCP store serves the group
        # Private (torch's stubs omit it): the only way to give Gloo a timeout and devices.
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = IDLE_TIMEOUT
        host = init_method.removeprefix("tcp://").rpartition(":")[0].strip("[]")
        # Gloo listens where its host name resolves; a group on one host keeps to
        # loopback, as every other socket of the server does.
        options._devices = [dist.ProcessGroupGloo.create_device(interface="lo")
                            if init_method.startswith("file://")
                            or host in ("127.0.0.1", "localhost", "::1")
                            else dist.ProcessGroupGloo.create_default_device()]
        # Any: torch's stubs give ProcessGroupGloo none of the collectives it has (barrier,
        # broadcast), and `close` sets it to None.
        self._cpu: Any = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), self.rank,
                                               self.world, options)
        self._shm = self._shared_memory(store) if (
            shm and placement.local_world == self.world and shm_collectives.available()) else None
        self._cuda = None
        if device.type == "cuda":
            nccl = dist.ProcessGroupNCCL.Options()
            nccl._timeout = IDLE_TIMEOUT
            self._cuda = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), self.rank,
                                               self.world, nccl)

    def _meet(self, init_method: str):
        """The group's store, once every rank has reached it (within START_TIMEOUT)."""
        dist = self._dist
        if init_method.startswith("file://"):
            store = dist.FileStore(init_method.removeprefix("file://"), self.world)
            store.set_timeout(START_TIMEOUT)
        else:
            host, _, port = init_method.removeprefix("tcp://").rpartition(":")
            store = dist.TCPStore(host.strip("[]"), int(port), self.world,
                                  is_master=self.leader, timeout=START_TIMEOUT)
        store.set(f"arrived/{self.rank}", b"1")
        store.wait([f"arrived/{r}" for r in range(self.world)], START_TIMEOUT)
        return store

    def _shared_memory(self, store) -> shm_collectives.ShmCollectives:
        """The host's segment: made by rank 0, opened by the others, unlinked once all
        have it (so nothing is left in /dev/shm however the ranks end)."""
        if self.leader:  # named to the others only once the file exists
            shm = shm_collectives.ShmCollectives(
                self.rank, self.world, shm_collectives.ShmCollectives.new_path(), create=True)
            store.set("shm/path", shm.path)
        else:
            shm = shm_collectives.ShmCollectives(self.rank, self.world,
                                                 store.get("shm/path").decode(), create=False)
        store.set(f"shm/pid/{self.rank}", str(os.getpid()))
        keys = [f"shm/pid/{r}" for r in range(self.world)]
        store.wait(keys, START_TIMEOUT)
        shm.pids = [int(store.get(k)) for k in keys]
        self._cpu.barrier().wait()
        if self.leader:
            shm.unlink()
        return shm

    def _group(self, t: torch.Tensor):
        return self._cuda if t.is_cuda and self._cuda is not None else self._cpu

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # -- the layers' collectives -----------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, op: str = "SUM") -> torch.Tensor:
        """Reduce `t` over the ranks, in place: a sum (a row-parallel layer's partial
        outputs), or `MIN` / `MAX`."""
        if self.world > 1 and op == "SUM" and self._shm is not None and self._shm.fits(t):
            self._shm.sum_(t)
        elif self.world > 1:
            options = self._dist.AllreduceOptions()
            options.reduceOp = getattr(self._dist.ReduceOp, op)
            self._group(t).allreduce([t], options).wait()
        return t

    def gather_columns(self, t: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's `t` (`[rows, n]`, the same `n` on every rank) side by side,
        `[rows, world * n]`, in rank order; other ranks: None."""
        if self.world == 1:
            return t
        t = t.contiguous()
        if self._shm is not None and self._shm.fits(t):
            parts = self._shm.gather(t)
            return torch.cat(parts, dim=1) if parts is not None else None
        options = self._dist.GatherOptions()
        options.rootRank = 0
        parts = [torch.empty_like(t) for _ in range(self.world)] if self.leader else []
        self._group(t).gather([parts] if self.leader else [], [t], options).wait()
        return torch.cat(parts, dim=1) if self.leader else None

    def all_min(self, n: int) -> int:
        """The least of every rank's `n` (e.g. KV blocks that fit on each device)."""
        if self.world == 1:
            return n
        return int(self.all_reduce(torch.tensor([n], dtype=torch.int64), "MIN").item())

    def any_of(self, flags: list[bool]) -> list[bool]:
        """Element-wise: whether any rank's flag is set (e.g. a disk entry one rank could
        not read is unreadable for all)."""
        if self.world == 1 or not flags:
            return flags
        t = self.all_reduce(torch.tensor(flags, dtype=torch.int32), "MAX")
        return [bool(v) for v in t.tolist()]

    # -- steps from rank 0 -----------------------------------------------------------------
    def share(self, msg: WorkerInput) -> None:
        """Rank 0: hand `msg` to every other rank (no-op with one rank). RuntimeError once
        the group is `broken`."""
        if self.broken is not None:
            raise RuntimeError(f"the tensor-parallel ranks are out of step since a call "
                               f"failed ({self.broken}): restart them (a new Engine; a "
                               "server restarts its ranks itself)")
        if self.world > 1:
            self._broadcast(self._encoder.encode(msg))

    @contextmanager
    def failing(self) -> Iterator[None]:
        """Around a shared call's own work: if it raises, the ranks may be waiting in
        different collectives, so the group is `broken` and never used again (sharing
        another call would meet the others' collective and hang or mix them up)."""
        try:
            yield
        except Exception as e:
            if self.world > 1:
                self.broken = repr(e)
            raise

    def stop_followers(self) -> None:
        """Rank 0: tell the other ranks to return from `Worker.follow` (an empty step);
        a broken group's are stopped by their parent instead."""
        if self.world > 1 and self.broken is None:
            self._broadcast(b"")

    def receive(self) -> WorkerInput | None:
        """Another rank: the next step or control call rank 0 shared; None to stop."""
        size = self._bcast(torch.zeros(1, dtype=torch.int64))
        n = int(size.item())
        if n == 0:
            return None
        if not 0 < n <= MAX_STEP_BYTES:
            raise RuntimeError(f"rank 0 announced a step of {n} bytes (at most "
                               f"{MAX_STEP_BYTES})")
        data = self._bcast(torch.empty(n, dtype=torch.uint8))
        return decode(self._decoder, data.numpy().tobytes())

    def _broadcast(self, data: bytes) -> None:
        self._bcast(torch.tensor([len(data)], dtype=torch.int64))
        if data:
            self._bcast(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        options = self._dist.BroadcastOptions()
        options.rootRank = 0
        self._cpu.broadcast([t], options).wait()
        return t

    def close(self) -> None:
        """Leave the group (its connections close; the others' next collective fails)."""
        if self.world > 1:
            for group in (self._cpu, self._cuda):
                if group is not None:
                    group.shutdown()
            self._cpu = self._cuda = None
