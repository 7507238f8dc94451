"""The worker process's loop (server/processes.py:WorkerLoop) over a real ZeroMQ pair, with a worker
that records what it is asked and a device that says when its steps are done: a step that
arrives while another runs is launched before the first is answered (as on a GPU); answers
go back in launch order, a failed launch answered by its failure in its place; on a device
that is idle after each launch (the CPU) every step is answered before the next is taken."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import msgspec
import pytest
import zmq

from radixserve.messages import (ControlReply, ForwardBatch, ForwardResult, StepResult,
                                 WorkerFailed, WorkerOutput)
from radixserve.messages.worker import ReleaseViewsRequest
from radixserve.server.processes import WorkerLoop


class RecordingWorker:
    def __init__(self, fail_on: int | None = None) -> None:
        self.log: list[str] = []
        self.launched: list[int] = []
        self.fail_on = fail_on
        self.tp = SimpleNamespace(world=1)
        self.device = SimpleNamespace(type="cpu")

    def launch(self, batch: ForwardBatch) -> None:
        step = batch.q_lens[0]  # the test numbers its steps in q_lens
        self.log.append(f"launch {step}")
        if step == self.fail_on:
            raise RuntimeError(f"step {step} failed")
        self.launched.append(step)

    def collect(self) -> ForwardResult:
        step = self.launched.pop(0)
        self.log.append(f"answer {step}")
        return ForwardResult(outputs=[], forward_seconds=float(step))

    def control(self, call: ReleaseViewsRequest) -> dict:
        self.log.append("control")
        return {"ok": True}


def step(n: int) -> ForwardBatch:
    return ForwardBatch(seqs=[n], input_ids=[n], q_lens=[n], kv_lens=[n], unsampled=[0],
                        logprobs=[None])


@pytest.fixture
def pair():
    ctx = zmq.Context()
    here, there = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    here.bind("inproc://worker-loop")
    there.connect("inproc://worker-loop")
    yield here, there
    here.close(linger=0)  # the loop's thread (a daemon) stays blocked on its socket


def serve(worker: RecordingWorker, sock: zmq.Socket, idle) -> None:
    loop = WorkerLoop(worker, sock, idle=idle)  # type: ignore[arg-type]
    threading.Thread(target=loop.run, daemon=True).start()


def answers(sock: zmq.Socket, count: int) -> list[WorkerOutput]:
    decoder = msgspec.msgpack.Decoder(WorkerOutput)
    got = []
    for _ in range(count):
        assert sock.poll(5000), "no answer within 5 s"
        got.append(decoder.decode(sock.recv()))
    return got


def test_a_step_that_arrives_while_one_runs_is_launched_before_the_first_is_answered(pair):
    scheduler, sock = pair
    worker = RecordingWorker()  # the device finishes step 1 only once step 2 is launched
    serve(worker, sock, idle=lambda: "launch 2" in worker.log)
    encode = msgspec.msgpack.Encoder().encode
    scheduler.send(encode(step(1)))
    scheduler.send(encode(step(2)))
    first, second = answers(scheduler, 2)
    assert worker.log == ["launch 1", "launch 2", "answer 1", "answer 2"]
    assert [a.result.forward_seconds for a in (first, second)] == [1.0, 2.0]
    scheduler.send(encode(ReleaseViewsRequest(call_id=9)))
    (reply,) = answers(scheduler, 1)
    assert isinstance(reply, ControlReply) and reply.call_id == 9


def test_a_failed_launch_is_answered_in_its_place(pair):
    scheduler, sock = pair
    worker = RecordingWorker(fail_on=2)
    serve(worker, sock, idle=lambda: "launch 3" in worker.log)
    encode = msgspec.msgpack.Encoder().encode
    for n in (1, 2, 3):
        scheduler.send(encode(step(n)))
    got = answers(scheduler, 3)
    assert isinstance(got[0], StepResult) and got[0].result.forward_seconds == 1.0
    assert isinstance(got[1], WorkerFailed) and "step 2 failed" in got[1].message
    assert isinstance(got[2], StepResult) and got[2].result.forward_seconds == 3.0


def test_on_an_idle_device_each_step_is_answered_before_the_next_is_taken(pair):
    scheduler, sock = pair
    worker = RecordingWorker()
    serve(worker, sock, idle=None)  # the CPU's: a launch computes the step
    encode = msgspec.msgpack.Encoder().encode
    scheduler.send(encode(step(1)))
    scheduler.send(encode(step(2)))
    answers(scheduler, 2)
    assert worker.log == ["launch 1", "answer 1", "launch 2", "answer 2"]
