"""Thin process wrappers: they pump messages between sockets and the Scheduler / Worker.

Each runs in its own process, started by the front door as a `python -c` child (`spawn.py`).
The worker process owns the model and the KV pool. The scheduler process imports no model
code, but loads the same tokenizer as the front door (transformers, which brings torch in)
so that stop strings are matched in exactly the text the caller gets.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, cast

import msgspec
import zmq

from radixserve.config import EngineConfig
from radixserve.disk_layout import adopt
from radixserve.messages import (ControlReply, ForwardBatch, ForwardResult, SchedulerInput,
                                 SchedulerReady, StepResult, UpdateBatch, WorkerCall,
                                 WorkerFailed, WorkerInput, WorkerOutput, WorkerReady, decode)
from radixserve.server.spawn import Child
from radixserve.worker.tensor_parallel import Placement

if TYPE_CHECKING:  # the scheduler's process, which shares this module, imports no model code
    import torch

    from radixserve.worker.worker import Worker

log = logging.getLogger(__name__)
WATCHDOG_EXIT = 75
"""The scheduler's exit status when its watchdog saw a worker step never finish; the
supervisor then kills the worker (SIGKILL) and restarts both, failing calls `worker_hung`."""
CACHE_EVENTS_HEARTBEAT = 1.0
"""Seconds between two CacheEvents when nothing changes: a subscriber learns the epoch and
that the replica is alive, and sees a lost event as a `seq` gap within a second."""


@dataclass(frozen=True)
class IpcPaths:
    """Internal endpoints, all inside one private temporary directory."""

    root: str

    @property
    def scheduler(self) -> str:
        return f"ipc://{self.root}/scheduler"

    @property
    def front_door(self) -> str:
        return f"ipc://{self.root}/front_door"

    @property
    def worker(self) -> str:
        return f"ipc://{self.root}/worker"


def die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies, so a crashed or killed front
    door leaves no orphans behind. Ctrl-C is the parent's to handle: it stops its children
    in order."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def adopt_disk(config: EngineConfig, disk_fd: int | None) -> None:
    """Take the disk tier's directory as the process that started this one pinned it
    (`disk_layout.adopt`): never its path again, which may name another directory by now."""
    if disk_fd is not None and config.kv_disk_dir is not None:
        adopt(config.kv_disk_dir, disk_fd)


def worker_main(config: EngineConfig, model_dir: str, paths: IpcPaths,
                init_method: str | None = None, disk_fd: int | None = None) -> None:
    """The worker (with tensor parallelism, rank 0 of the group meeting at `init_method`)."""
    die_with_parent()
    adopt_disk(config, disk_fd)
    logging.basicConfig(level=logging.INFO, format="[worker] %(message)s")
    from radixserve.worker.worker import Worker

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.connect(paths.worker)
    encoder = msgspec.msgpack.Encoder()
    try:
        worker = Worker(config, Path(model_dir), placement(config, 0), init_method)
        worker.warmup()
    except Exception as e:  # report why start-up failed instead of dying silently
        log.exception("worker failed to start")
        sock.send(encoder.encode(WorkerFailed(f"worker failed to start: {e!r}")))
        time.sleep(0.5)
        raise SystemExit(1) from e
    sock.send(encoder.encode(WorkerReady(worker.info())))
    WorkerLoop(worker, sock).run()


MAX_IN_FLIGHT = 2
"""Steps launched and not answered: the scheduler runs at most one step ahead."""


def device_idle(device: torch.device) -> Callable[[], bool] | None:
    """Whether the device has finished every step launched on it (so the oldest answer is
    ready without waiting); None: always (a CPU launch computes the step before it
    returns)."""
    if device.type == "cuda":
        import torch

        return torch.cuda.current_stream(device).query
    return None


class WorkerLoop:
    """The worker process's loop over `sock` (the scheduler's PAIR socket): each step
    launched as it arrives, answered as it completes, until the process ends.

    With overlap scheduling the scheduler process sends step N+1 before it reads step N's
    answer (`RemoteWorker`, scheduler/overlap.py). On a GPU `Worker.launch` only queues a
    step's kernels, so N+1 is launched as soon as it arrives, while N still runs, and N is
    answered when the device is done with it: the device does not wait for the host between
    two steps. On the CPU a launch computes the whole step, so the device is idle when it
    returns and N is answered at once: the scheduler folds N while this process computes
    N+1. Answers go back in launch order, one per step (a step that failed to launch is
    answered by its failure, in its place); control calls come only between steps
    (`RemoteWorker.control`)."""

    def __init__(self, worker: Worker, sock: zmq.Socket,
                 idle: Callable[[], bool] | None = None) -> None:
        self.worker, self.sock = worker, sock
        self.idle = idle if idle is not None else device_idle(worker.device)
        """Whether the steps launched are done (`device_idle`)."""
        self.in_flight: deque[Callable[[], WorkerOutput]] = deque()
        """Per step launched and not answered, in order: what answers it."""
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(WorkerInput)

    def run(self) -> None:
        while True:
            if self.in_flight and (self.idle is None or len(self.in_flight) >= MAX_IN_FLIGHT
                                   or self.idle()):
                self.sock.send(self.encoder.encode(self.in_flight.popleft()()))
            elif not self.in_flight or self.sock.poll(0):  # while a step runs: spin on both
                self.take(decode(self.decoder, self.sock.recv()))

    def take(self, msg: WorkerInput) -> None:
        if not isinstance(msg, ForwardBatch):  # a control call, between steps
            self.sock.send(self.encoder.encode(self.control(msg)))
            return
        try:
            self.worker.launch(msg)
        except Exception as e:
            self.in_flight.append(self.failed(e))
            return
        self.in_flight.append(self.collect)

    def collect(self) -> WorkerOutput:
        try:
            return StepResult(self.worker.collect())
        except Exception as e:
            return self.failed(e)()

    def failed(self, e: Exception) -> Callable[[], WorkerOutput]:
        log.exception("forward step failed")
        if self.worker.tp.world > 1:  # the group is broken (a rank died): restart them all
            logging.shutdown()
            os._exit(1)
        reply = WorkerFailed(f"forward step failed: {e!r}")
        return lambda: reply

    def control(self, msg: WorkerCall) -> WorkerOutput:
        try:
            return ControlReply(msg.call_id, self.worker.control(msg))
        except ValueError as e:
            return ControlReply(msg.call_id, {}, error=str(e))
        except Exception as e:  # e.g. an unmap that failed: the worker goes on
            log.exception("control call failed")
            return WorkerFailed(f"control call failed: {e!r}")


def placement(config: EngineConfig, rank: int) -> Placement:
    return Placement(rank, config.tp_size, config.tp_size // config.nnodes)


def rank_main(config: EngineConfig, model_dir: str, rank: int, init_method: str,
              disk_fd: int | None = None) -> None:
    """A tensor-parallel rank other than 0: runs its shard of each step rank 0 shares, and
    exits when rank 0 says stop or the group breaks (its parent then restarts the ranks)."""
    die_with_parent()
    adopt_disk(config, disk_fd)
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(message)s")
    from radixserve.worker.worker import Worker

    worker = Worker(config, Path(model_dir), placement(config, rank), init_method)
    worker.follow()
    worker.close()


def start_ranks(config: EngineConfig, model_dir: str, init_method: str,
                disk_fd: int | None = None) -> list[Child]:
    """This host's ranks but rank 0 (all of its ranks on a node other than the first), as
    children of this process (`disk_fd`: the disk tier's pinned directory, handed down)."""
    per_node = config.tp_size // config.nnodes
    first = config.node_rank * per_node
    fds = () if disk_fd is None else (disk_fd,)
    return [Child(rank_main, (config, model_dir, rank, init_method, disk_fd),
                  name=f"radixserve-rank{rank}", pass_fds=fds)
            for rank in range(max(first, 1), first + per_node)]


class RemoteWorker:
    """The worker process as the core's `forward` (or `launch` and `collect`): sends the
    batch, and while the worker computes keeps serving the scheduler's inbox (requests,
    aborts, control calls). With overlap scheduling the next step is sent before this one's
    answer is read, so the worker process finds it waiting when it is done."""

    def __init__(self, sock: zmq.Socket, inbox: zmq.Socket, serve_inbox: Callable[[], None],
                 watchdog_timeout: float | None = None) -> None:
        self.sock, self.inbox, self.serve_inbox = sock, inbox, serve_inbox
        self.watchdog_timeout = watchdog_timeout
        """A step the worker has not answered after this many seconds ends this process
        with WATCHDOG_EXIT (`_hung`); None: wait for ever."""
        self.poller = zmq.Poller()
        self.poller.register(inbox, zmq.POLLIN)
        self.poller.register(sock, zmq.POLLIN)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(WorkerOutput)

    def forward(self, batch: ForwardBatch) -> ForwardResult:
        """`launch` then `collect`: one step, waited for."""
        self.sock.send(self.encoder.encode(batch))
        return self.collect()

    def launch(self, batch: ForwardBatch) -> None:
        """Send a step; the worker process runs the steps, and answers them, in order."""
        self.sock.send(self.encoder.encode(batch))

    def collect(self) -> ForwardResult:
        """The answer to the oldest step sent and not collected (meanwhile serving the
        inbox); raises if the worker failed it."""
        deadline = None if self.watchdog_timeout is None else (
            time.monotonic() + self.watchdog_timeout)
        while True:
            wait = None if deadline is None else max(0, deadline - time.monotonic())
            events = dict(self.poller.poll(None if wait is None else int(wait * 1000) + 1))
            if self.inbox in events:
                self.serve_inbox()
            if self.sock in events:
                break
            if deadline is not None and time.monotonic() >= deadline:
                self._hung("forward step")
        reply = decode(self.decoder, self.sock.recv())
        if isinstance(reply, StepResult):
            return reply.result
        raise RuntimeError(getattr(reply, "message", "worker error"))

    def control(self, call: WorkerCall) -> dict[str, Any]:
        """Only between steps (`WorkerCalls.run`): the socket is lockstep."""
        self.sock.send(self.encoder.encode(call))
        timeout = None if self.watchdog_timeout is None else int(self.watchdog_timeout * 1000)
        if not self.sock.poll(timeout):
            self._hung("control call")
        reply = decode(self.decoder, self.sock.recv())
        if not isinstance(reply, ControlReply):
            raise RuntimeError(getattr(reply, "message", "worker error"))
        if reply.error is not None:
            raise ValueError(reply.error)
        return reply.payload

    def _hung(self, what: str) -> None:
        log.error("the worker has not finished a %s in %gs (watchdog_timeout): exiting so that "
                  "the supervisor kills and restarts it", what, self.watchdog_timeout)
        logging.shutdown()
        os._exit(WATCHDOG_EXIT)  # nothing here can be saved: the front door fails the calls


def scheduler_main(config: EngineConfig, model_dir: str, eos_token_ids: list[int],
                   paths: IpcPaths, watchdog_timeout: float | None = None,
                   cache_secret: bytes = b"", disk_fd: int | None = None) -> None:
    die_with_parent()
    adopt_disk(config, disk_fd)
    logging.basicConfig(level=logging.INFO, format="[scheduler] %(message)s")
    from radixserve.model.loader import load_tokenizer
    from radixserve.scheduler.core import EngineCore
    from radixserve.scheduler.scheduler import Scheduler
    from radixserve.stop_strings import Decode

    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(paths.scheduler)
    front_door = ctx.socket(zmq.PUSH)
    front_door.connect(paths.front_door)
    worker = ctx.socket(zmq.PAIR)
    worker.bind(paths.worker)
    encoder = msgspec.msgpack.Encoder()
    tokenizer = load_tokenizer(model_dir)  # the front door's own decoder, for stop strings
    ready = decode(msgspec.msgpack.Decoder(WorkerOutput), worker.recv())
    if isinstance(ready, WorkerFailed):
        log.error(ready.message)
        raise SystemExit(1)
    assert isinstance(ready, WorkerReady)
    inbox_decoder = msgspec.msgpack.Decoder(SchedulerInput)

    def serve_inbox(timeout_ms: int = 0) -> None:
        """Handle every queued message, waiting up to `timeout_ms` for the first (-1: for
        as long as it takes)."""
        if inbox.poll(timeout_ms):
            while True:
                try:
                    reply = core.handle(decode(inbox_decoder, inbox.recv(zmq.NOBLOCK)))
                except zmq.Again:
                    return
                if reply is not None:
                    front_door.send(encoder.encode(reply))

    sched = Scheduler(config, ready.info, decode=cast(Decode, tokenizer.decode),
                      eos_token_ids=eos_token_ids, cache_events=True,
                      cache_secret=cache_secret)
    core = EngineCore(sched, RemoteWorker(worker, inbox, serve_inbox, watchdog_timeout),
                      ready.info)
    front_door.send(encoder.encode(SchedulerReady(ready.info)))
    stopping: list[int] = []
    if config.kv_disk_dir is not None:
        # SIGTERM (the supervisor stopping the server) ends the loop after the current step,
        # so that `close` can write the cache to the disk tier while the worker is there.
        # Without a disk tier there is nothing to save: SIGTERM ends the process at once.
        signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
    heartbeat_at = time.monotonic()  # the first CacheEvents goes at once: it names the epoch
    outbox = core.outbox
    while not stopping:
        wait = core.wait_limit(max(0.0, heartbeat_at - time.monotonic()))
        serve_inbox(-1 if wait is None else math.ceil(wait * 1000))
        updates = core.step()
        # What this step (or a flush) did to the tree, or to the load; else nothing but a
        # heartbeat when one is due. Sent before the step's updates, so that a router
        # tends to see a request's pages stored before it sees the request end.
        now = time.monotonic()
        events = core.take_cache_events(heartbeat=now >= heartbeat_at)
        if events is not None:
            front_door.send(encoder.encode(events))
            heartbeat_at = now + CACHE_EVENTS_HEARTBEAT
        if updates:
            front_door.send(encoder.encode(UpdateBatch(updates)))
        if outbox:  # answers and refusals that came after their message
            for msg in outbox:
                front_door.send(encoder.encode(msg))
            outbox.clear()
    core.close()
    # The front door closes its end before it stops this process: what is still unsent to it
    # has no reader, and the default linger would wait for one for ever.
    ctx.destroy(linger=0)
