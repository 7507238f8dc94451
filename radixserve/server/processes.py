"""Thin process wrappers: they pump messages between sockets and the Scheduler / Worker.

Each runs in its own process, started by the front door as a `python -c` child (`spawn.py`).
The scheduler process never imports torch; the worker process owns the model and the KV pool.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

from radixserve.config import EngineConfig
from radixserve.messages import (AbortRequest, ControlReply, ControlRequest, ForwardBatch,
                                 RequestRejected, SchedulerInput, SchedulerReady, StepResult,
                                 TokenizedRequest, UpdateBatch, WorkerFailed, WorkerOutput,
                                 WorkerReady)

log = logging.getLogger(__name__)


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

    @property
    def http_gateway(self) -> str:
        """The front door's second RPC endpoint, for the HTTP server (a thread of its process)."""
        return f"ipc://{self.root}/http_gateway"


def die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies, so a crashed or killed front
    door leaves no orphans behind. Ctrl-C is the parent's to handle: it stops its children
    in order."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def worker_main(config: EngineConfig, model_dir: str, paths: IpcPaths) -> None:
    die_with_parent()
    logging.basicConfig(level=logging.INFO, format="[worker] %(message)s")
    from radixserve.worker.worker import Worker

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.connect(paths.worker)
    encoder = msgspec.msgpack.Encoder()
    try:
        worker = Worker(config, Path(model_dir))
        worker.warmup()
    except Exception as e:  # report why start-up failed instead of dying silently
        log.exception("worker failed to start")
        sock.send(encoder.encode(WorkerFailed(f"worker failed to start: {e!r}")))
        time.sleep(0.5)
        raise SystemExit(1) from e
    sock.send(encoder.encode(WorkerReady(worker.info())))
    decoder = msgspec.msgpack.Decoder(ForwardBatch)
    while True:
        batch = decoder.decode(sock.recv())
        try:
            reply: WorkerOutput = StepResult(worker.forward(batch))
        except Exception as e:
            log.exception("forward step failed")
            reply = WorkerFailed(f"forward step failed: {e!r}")
        sock.send(encoder.encode(reply))


def scheduler_main(config: EngineConfig, model_dir: str, eos_token_ids: list[int],
                   paths: IpcPaths) -> None:
    die_with_parent()
    logging.basicConfig(level=logging.INFO, format="[scheduler] %(message)s")
    from tokenizers import Tokenizer

    from radixserve.scheduler.scheduler import OverloadedError, Scheduler

    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(paths.scheduler)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(paths.front_door)
    worker = ctx.socket(zmq.PAIR)
    worker.bind(paths.worker)
    encoder = msgspec.msgpack.Encoder()
    worker_decoder = msgspec.msgpack.Decoder(WorkerOutput)
    ready = worker_decoder.decode(worker.recv())
    if isinstance(ready, WorkerFailed):
        log.error(ready.message)
        raise SystemExit(1)
    assert isinstance(ready, WorkerReady)
    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    sched = Scheduler(config, ready.info, eos_token_ids=eos_token_ids,
                      decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
    outbox.send(encoder.encode(SchedulerReady(ready.info)))
    inbox_decoder = msgspec.msgpack.Decoder(SchedulerInput)
    forward_seconds = 0.0

    def take(msg: TokenizedRequest | AbortRequest | ControlRequest) -> None:
        if isinstance(msg, TokenizedRequest):
            try:
                sched.add_request(msg)
            except OverloadedError as e:
                outbox.send(encoder.encode(RequestRejected(msg.rid, "overloaded", str(e))))
            except ValueError as e:
                outbox.send(encoder.encode(RequestRejected(msg.rid, "invalid_request", str(e))))
        elif isinstance(msg, AbortRequest):
            sched.abort(msg.rid)
        elif msg.op == "flush_cache":
            outbox.send(encoder.encode(ControlReply(msg.call_id, {"flushed": sched.flush_cache()})))
        else:
            stats = {**sched.stats(), "forward_seconds_total": forward_seconds}
            outbox.send(encoder.encode(ControlReply(msg.call_id, stats)))

    def drain(timeout_ms: int) -> None:
        """Take every queued message, waiting up to `timeout_ms` for the first."""
        if inbox.poll(timeout_ms):
            while True:
                try:
                    take(inbox_decoder.decode(inbox.recv(zmq.NOBLOCK)))
                except zmq.Again:
                    return

    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    poller.register(worker, zmq.POLLIN)
    while True:
        drain(0 if sched.has_work else 1000)
        batch, updates = sched.schedule()
        if batch is not None:
            started = time.perf_counter()
            worker.send(encoder.encode(batch.forward))
            # While the worker computes, keep taking requests, aborts and control calls.
            while True:
                events = dict(poller.poll())
                if inbox in events:
                    drain(0)
                if worker in events:
                    break
            reply = worker_decoder.decode(worker.recv())
            forward_seconds += time.perf_counter() - started
            if isinstance(reply, StepResult):
                updates += sched.process_result(batch, reply.result)
            else:
                updates += sched.fail_batch(batch, getattr(reply, "message", "worker error"))
        if updates:
            outbox.send(encoder.encode(UpdateBatch(updates)))
