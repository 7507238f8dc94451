"""CUDA-graph decode (`worker/cuda_graph.py`) on the CPU: its eager mode runs the very buffers,
padding rows and reserved block the captured graphs replay, so greedy output through it must
equal transformers, with batches padded to the next size, steps too wide for the graphs run
eagerly, and both counted. The capture itself needs a GPU (`TestOnGPU`)."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve.config import EngineConfig
from radixserve.worker import cuda_graph
from radixserve.worker.attention.torch_backend import TorchAttentionBackend
from radixserve.worker.attention.triton_backend import TritonAttentionBackend, interpreting
from radixserve.worker.cuda_graph import capture_sizes
from tests.conftest import ENGINE_TEST_DEFAULTS, checked_engine
from tests.factories import tiny_model_dir
from tests.hf_reference import HFReference, assert_matches_reference

MAX_NEW = 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("graphs"), num_layers=2, hidden_size=64)


@pytest.fixture
def graphs_on(monkeypatch):
    """Graph decode wanted on this CPU: its eager mode, the worker's CPU stand-in."""
    monkeypatch.setattr(cuda_graph, "wanted", lambda *args: True)


def test_wanted_only_where_the_backend_can_be_captured() -> None:
    """The torch backend reads lengths back and sizes index tensors per step: never
    captured, whatever the device; the Triton backend is, on CUDA alone."""
    config, cuda = EngineConfig(model="unused"), torch.device("cuda")
    assert cuda_graph.wanted(config, cuda, 1, TritonAttentionBackend())
    assert not cuda_graph.wanted(config, cuda, 1, TorchAttentionBackend())
    assert not cuda_graph.wanted(config, torch.device("cpu"), 1, TritonAttentionBackend())
    assert not cuda_graph.wanted(config, cuda, 2, TritonAttentionBackend())


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]


def run(tiny, prompts: list[list[int]], **config) -> tuple[list[list[int]], dict, int]:
    """Greedy `prompts` at once: outputs, stats, and the blocks the scheduler was given."""
    with checked_engine(tiny, **{**ENGINE_TEST_DEFAULTS, "context_length": 256,
                                 "cascade_min_shared_tokens": 10_000, **config}) as engine:
        results = engine.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True})
        return [r["output_ids"] for r in results], engine.stats(), engine.stats()["num_blocks"]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("max_bs", [8, 4])
def test_greedy_through_the_graph_buffers_equals_transformers(tiny, graphs_on, backend, max_bs):
    """Five sequences: padded to 8 under max_bs 8 (every decode step a graph's), too wide
    for max_bs 4 (eager, counted) until they end together."""
    if backend == "triton" and not interpreting():
        pytest.skip("the Triton kernels run on the CPU only with TRITON_INTERPRET=1")
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 5000) for _ in range(9 + 11 * i)] for i in range(5)]
    outputs, stats, blocks = run(tiny, prompts, attention_backend=backend,
                                 cuda_graph_max_bs=max_bs)
    hf = HFReference(tiny)
    for i, (ids, got) in enumerate(zip(prompts, outputs)):
        assert_matches_reference(got, hf.greedy(ids, MAX_NEW), f"prompt {i}")
    decodes = MAX_NEW - 1  # the first token comes from the prefill
    if max_bs == 8:
        assert stats["graph_steps"] >= decodes, stats
    else:
        assert stats["graph_steps"] == 0 and stats["eager_steps"] >= decodes, stats
    assert blocks == 8192 // 16 - 1  # the padding rows' block is never handed out


def test_sampled_output_is_the_same_with_and_without(tiny, monkeypatch):
    """Sampling happens after the graph: seeded samples equal the eager path's."""
    params = {"max_new_tokens": MAX_NEW, "temperature": 0.9, "top_p": 0.9, "seed": 7,
              "ignore_eos": True}
    prompts = [[11, 12, 13, 14], [200, 300, 400], [5, 6, 7, 8, 9, 10]]
    got = []
    for on in (False, True):
        monkeypatch.setattr(cuda_graph, "wanted", lambda *args, _on=on: _on)
        with checked_engine(tiny, **ENGINE_TEST_DEFAULTS, context_length=256) as engine:
            got.append([r["output_ids"] for r in engine.generate(input_ids=prompts,
                                                                 sampling_params=params)])
            assert (engine.stats()["graph_steps"] > 0) == on
    assert got[0] == got[1]


@pytest.mark.skipif(not torch.cuda.is_available() or interpreting(),
                    reason="needs a CUDA device, with the kernels compiled (TRITON_INTERPRET=0)")
class TestOnGPU:
    def test_captured_graphs_equal_eager_decode(self, tiny):
        rng = random.Random(5)
        prompts = [[rng.randrange(100, 5000) for _ in range(20 + 13 * i)] for i in range(6)]
        on, stats, _ = run(tiny, prompts, dtype="float32")
        off, _, _ = run(tiny, prompts, dtype="float32", disable_cuda_graph=True)
        assert on == off and stats["graph_steps"] >= MAX_NEW - 1, stats
