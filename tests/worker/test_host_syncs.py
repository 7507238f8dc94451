"""Host syncs per decode step, counted on the CPU (issue 52): every read of a device value
back to the host (`.item()`, `int()`/`bool()` of a tensor, `.tolist()`, `nonzero` and the
other ops whose output size depends on the data) makes the host wait for the device on a
GPU, and a decode step may have one: its `Readback` (worker/logits.py: the sampled tokens
and any logprobs, copied back together and waited for in `collect`). On the CPU these ops
run all the same, so counting them through a dispatch mode (and `Tensor.tolist`, which
dispatches nothing) on the CPU worker counts what the GPU would wait for, in the same code:
a `Readback.wait` counts one, the lists it makes of its host copies none. Counted for
greedy and sampled rows, with penalties, bias and logprobs, through the torch and Triton
backends, in the Engine and through the worker process's loop that `serve` runs."""

from __future__ import annotations

import os
import threading
from collections import Counter
from typing import Any, Callable, Iterator

import msgspec
import pytest
import torch
import zmq
from torch.utils._python_dispatch import TorchDispatchMode

from radixserve.messages import ForwardBatch, StepResult, WorkerOutput
from radixserve.server.processes import WorkerLoop
from radixserve.worker.logits import Readback
from radixserve.worker.worker import Worker
from tests.conftest import checked_engine
from tests.factories import tiny_model_dir

READS_BACK = {"aten._local_scalar_dense.default", "aten.nonzero.default",
              "aten.masked_select.default", "aten._unique2.default", "aten.unique_dim.default",
              "aten.repeat_interleave.Tensor", "aten.bincount.default"}
"""Ops whose result the host must wait for (a value, or a size that depends on the data)."""


class CountReads(TorchDispatchMode):
    def __init__(self, seen: Counter[str]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in READS_BACK:
            self.seen[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def reads(monkeypatch) -> Iterator[dict[str, list[Any]]]:
    """Reads back of each step, by kind of step ("decode": every row one token; "mixed":
    else, with each one's `q_lens` under "q_lens"), summed over its launch and its
    collect."""
    each: dict[str, list[Any]] = {"decode": [], "mixed": [], "q_lens": []}
    launched: list[Counter[str]] = []
    real_launch, real_collect, real_tolist = Worker.launch, Worker.collect, torch.Tensor.tolist
    real_wait = Readback.wait
    current: list[Counter[str]] = []

    def tolist(self: torch.Tensor) -> Any:
        if current:
            current[-1]["tolist"] += 1
        return real_tolist(self)

    def wait(self: Readback) -> list[Any]:
        current[-1]["readback"] += 1
        current.append(Counter())  # its lists are of host copies: no wait of their own
        try:
            return real_wait(self)
        finally:
            current.pop()

    def counted(step: Counter[str], run: Callable[[], Any]) -> Any:
        current.append(step)
        try:
            with CountReads(step):
                return run()
        finally:
            current.pop()

    def launch(self: Worker, batch: Any) -> None:
        kind = "decode" if batch.q_lens and set(batch.q_lens) == {1} else "mixed"
        each[kind].append(Counter())
        if kind == "mixed":
            each["q_lens"].append(list(batch.q_lens))
        launched.append(each[kind][-1])
        counted(each[kind][-1], lambda: real_launch(self, batch))

    def collect(self: Worker) -> Any:
        return counted(launched.pop(0), lambda: real_collect(self))

    monkeypatch.setattr(Worker, "launch", launch)
    monkeypatch.setattr(Worker, "collect", collect)
    monkeypatch.setattr(Readback, "wait", wait)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    yield each


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")


SAMPLINGS = [
    {"temperature": 0},
    {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 1},
    {"temperature": 0.7, "frequency_penalty": 0.5, "repetition_penalty": 1.1,
     "logit_bias": {"5": 2.0}},
]


def generate_each_sampling(engine: Any) -> None:
    """Two prompts, 8 tokens each, under each of `SAMPLINGS`."""
    for sampling in SAMPLINGS:
        engine.generate(prompt=["Hello there", "The capital of France is"],
                        sampling_params={"max_new_tokens": 8, "ignore_eos": True, **sampling})


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_decode_step_reads_back_once(tiny, reads, backend) -> None:
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton backend on the CPU runs under TRITON_INTERPRET=1")
    with checked_engine(tiny, attention_backend=backend) as engine:
        generate_each_sampling(engine)
        engine.generate(prompt=["Hi"], sampling_params={"max_new_tokens": 6},
                        return_logprob=True, top_logprobs_num=2)
    assert len(reads["decode"]) >= 20
    assert all(sum(c.values()) == 1 for c in reads["decode"]), reads["decode"]


def test_a_mixed_triton_step_reads_back_once_at_most(tiny, reads) -> None:
    """Prefill chunks beside running decodes (a long prompt chunked while a short one
    decodes) through the Triton backend, the GPU's: it splits the step by kind from the
    host's lengths (`AttentionMetadata.kinds`), so the step's one wait is still its
    tokens'. (The torch backend, the CPU's, reads its lengths back for its native kernels:
    `graph_capturable` is off for it.)"""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton backend on the CPU runs under TRITON_INTERPRET=1")
    long_prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 8)
    with checked_engine(tiny, attention_backend="triton", chunked_prefill_size=16,
                        enable_cascade_attention=False) as engine:
        engine.generate(prompt=["Hi", long_prompt],
                        sampling_params={"max_new_tokens": 8, "ignore_eos": True})
    assert sum(1 in q_lens and max(q_lens) > 1 for q_lens in reads["q_lens"]) >= 3, \
        reads["q_lens"]
    assert max(sum(c.values()) for c in reads["mixed"]) <= 1, reads["mixed"]


def test_a_tree_attention_step_reads_back_once_at_most(tiny, reads) -> None:
    """Steps with a cascade plan (decodes grouped over a shared prompt, and a prompt's
    chunks beside them) through the Triton backend: the split the plan makes
    (`CascadeSplit`) is built from the host's lengths, so the step's one wait is still its
    tokens'."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton backend on the CPU runs under TRITON_INTERPRET=1")
    shared = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)
    with checked_engine(tiny, attention_backend="triton", chunked_prefill_size=64,
                        cascade_min_shared_tokens=32, cascade_min_group_size=2,
                        cascade_cost_model=False) as engine:
        engine.generate(prompt=shared, sampling_params={"max_new_tokens": 1})
        engine.generate(prompt=[f"{shared} {q}" for q in ("one", "two", "three")] + [shared * 2],
                        sampling_params={"max_new_tokens": 8, "ignore_eos": True})
        assert engine.stats()["cascade_steps"] >= 4
    steps = reads["decode"] + reads["mixed"]
    assert all(sum(c.values()) <= 1 for c in steps), steps

def test_the_worker_process_loop_adds_no_read_back(tiny, reads) -> None:
    """Through `serve` a step crosses a socket to the worker process's loop
    (`server/processes.py:WorkerLoop`), which decodes it, launches it and answers it when
    the device is done: an Engine's step messages, replayed through that loop over a real
    ZeroMQ pair to a fresh worker, still read back once per decode step."""
    sent: list[bytes] = []
    launch = Worker.launch

    def recording(self: Worker, batch: ForwardBatch) -> None:
        sent.append(msgspec.msgpack.encode(batch))
        launch(self, batch)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Worker, "launch", recording)
        with checked_engine(tiny) as engine:
            generate_each_sampling(engine)
            config = engine.config
    reads["decode"].clear()
    ctx = zmq.Context()
    scheduler, sock = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    scheduler.bind("inproc://host-syncs")
    sock.connect("inproc://host-syncs")
    loop = WorkerLoop(Worker(config, tiny), sock)
    threading.Thread(target=loop.run, daemon=True).start()
    decoder = msgspec.msgpack.Decoder(WorkerOutput)
    try:
        for message in sent:
            scheduler.send(message)
            assert scheduler.poll(30_000), "the loop never answered"
            assert isinstance(decoder.decode(scheduler.recv()), StepResult)
    finally:
        scheduler.close(linger=0)  # the loop's thread (a daemon) stays blocked on its socket
    assert len(reads["decode"]) >= 20
    assert all(sum(c.values()) == 1 for c in reads["decode"]), reads["decode"]
