"""The worker process's loop: each step launched as it arrives, answered as it completes.

With overlap scheduling the scheduler process sends step N+1 before it reads step N's answer
(`RemoteWorker`, scheduler/overlap.py). On a GPU, `Worker.launch` only queues a step's kernels,
so the loop launches N+1 as soon as it arrives, while N still runs, and answers N when the
device is done with it: the device never waits for the host between two steps. On the CPU a
launch computes the whole step, so the device is idle when it returns and N is answered at
once: the scheduler folds N while this process computes N+1.

Answers go back in launch order, one per step (a step that failed to launch is answered by
its failure, in its place); control calls come only between steps (`RemoteWorker.control`).
"""

from __future__ import annotations

import logging
import os
from collections import deque
from typing import Callable

import msgspec
import torch
import zmq

from radixserve.messages import (ControlReply, ForwardBatch, StepResult, WorkerCall,
                                 WorkerFailed, WorkerInput, WorkerOutput, decode)
from radixserve.worker.worker import Worker

log = logging.getLogger(__name__)
MAX_IN_FLIGHT = 2
"""Steps launched and not answered: the scheduler runs at most one step ahead."""


def device_idle(device: torch.device) -> Callable[[], bool]:
    """Whether the device has finished every step launched on it (so the oldest answer is
    ready without waiting). A CPU launch computes the step before it returns."""
    if device.type == "cuda":
        return torch.cuda.current_stream(device).query
    return lambda: True


class WorkerLoop:
    """Serves `sock` (the scheduler's PAIR socket) with `worker` until the process ends."""

    def __init__(self, worker: Worker, sock: zmq.Socket,
                 idle: Callable[[], bool] | None = None) -> None:
        self.worker, self.sock = worker, sock
        self.idle = idle or device_idle(worker.device)
        """Whether the steps launched are done (`device_idle`)."""
        self.in_flight: deque[Callable[[], WorkerOutput]] = deque()
        """Per step launched and not answered, in order: what answers it."""
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(WorkerInput)

    def run(self) -> None:
        while True:
            if self.in_flight and (len(self.in_flight) >= MAX_IN_FLIGHT or self.idle()):
                self.sock.send(self.encoder.encode(self.in_flight.popleft()()))
            elif not self.in_flight or self.sock.poll(0):  # while a step runs: spin on both
                self.take(decode(self.decoder, self.sock.recv()))

    def take(self, msg: WorkerInput) -> None:
        if isinstance(msg, ForwardBatch):
            self.in_flight.append(self.launch(msg))
        else:  # a control call, between steps
            self.sock.send(self.encoder.encode(self.control(msg)))

    def launch(self, batch: ForwardBatch) -> Callable[[], WorkerOutput]:
        try:
            self.worker.launch(batch)
        except Exception as e:
            return self.failed(e)
        return self.collect

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
