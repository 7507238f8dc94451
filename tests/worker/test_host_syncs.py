"""Host syncs per decode step, counted on the CPU (issue 52): every read of a device value
back to the host (`.item()`, `int()`/`bool()` of a tensor, `.tolist()`, `nonzero` and the
other ops whose output size depends on the data) makes the host wait for the device on a
GPU, and a decode step may have one: its `Readback` (worker/logits.py: the sampled tokens
and any logprobs, copied back together and waited for in `collect`). On the CPU these ops
run all the same, so counting them through a dispatch mode (and `Tensor.tolist`, which
dispatches nothing) on the CPU worker counts what the GPU would wait for, in the same code:
a `Readback.wait` counts one, the lists it makes of its host copies none. Counted for
greedy and sampled rows, with penalties, bias and logprobs, through the torch and Triton
backends."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any, Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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
def reads(monkeypatch) -> Iterator[dict[str, Counter[str]]]:
    """Reads back per kind of step ("decode": every row one token; "mixed": else), summed
    over the launch and the collect of each step."""
    per_kind: dict[str, Counter[str]] = {"decode": Counter(), "mixed": Counter()}
    steps: Counter[str] = Counter()
    launched: list[str] = []
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

    def launch(self: Worker, batch: Any) -> None:
        kind = "decode" if batch.q_lens and set(batch.q_lens) == {1} else "mixed"
        steps[kind] += 1
        launched.append(kind)
        current.append(per_kind[kind])
        try:
            with CountReads(per_kind[kind]):
                real_launch(self, batch)
        finally:
            current.pop()

    def collect(self: Worker) -> Any:
        kind = launched.pop(0)
        current.append(per_kind[kind])
        try:
            with CountReads(per_kind[kind]):
                return real_collect(self)
        finally:
            current.pop()

    monkeypatch.setattr(Worker, "launch", launch)
    monkeypatch.setattr(Worker, "collect", collect)
    monkeypatch.setattr(Readback, "wait", wait)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    yield {"per_kind": per_kind, "steps": steps}  # type: ignore[misc]


def per_step(reads: dict, kind: str) -> float:
    return sum(reads["per_kind"][kind].values()) / max(reads["steps"][kind], 1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")


SAMPLINGS = [
    {"temperature": 0},
    {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 1},
    {"temperature": 0.7, "frequency_penalty": 0.5, "repetition_penalty": 1.1,
     "logit_bias": {"5": 2.0}},
]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_decode_step_reads_back_once(tiny, reads, backend) -> None:
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton backend on the CPU runs under TRITON_INTERPRET=1")
    with checked_engine(tiny, attention_backend=backend) as engine:
        for sampling in SAMPLINGS:
            engine.generate(prompt=["Hello there", "The capital of France is"],
                            sampling_params={"max_new_tokens": 8, "ignore_eos": True, **sampling})
        engine.generate(prompt=["Hi"], sampling_params={"max_new_tokens": 6},
                        return_logprob=True, top_logprobs_num=2)
    assert reads["steps"]["decode"] >= 20
    assert per_step(reads, "decode") == 1, reads["per_kind"]["decode"]
