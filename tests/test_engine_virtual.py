"""The greedy-equality matrix again, with `kv_layout="virtual"`: the paged layout's test
classes collected a second time in this module, where `engine` and `make_engine` build
virtual-layout engines (pytest resolves a test's fixtures in the module that collects it).
Cache on and off, chunk sizes 1/7/64, eviction and retraction, logprobs, and tree
attention's `n` = 4 and DSL fork, token for token against transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import pytest

from tests.conftest import ENGINE_TEST_DEFAULTS, assert_blocks_accounted
from tests.factories import tiny_model_dir
from tests.hf_reference import HFReference
from tests.test_engine_api import TestLogprobs as _Logprobs
from tests.test_engine_cascade import TestCascadeAgainstTransformers as _Cascade
from tests.test_engine_cascade import plans  # noqa: F401  (a fixture the cascade tests use)
from tests.test_engine_exact import TestAgainstTransformers as _Exact
from tests.test_engine_exact import TestChunkingAndPaging as _Chunking
from tests.test_engine_exact import QUESTIONS, SYSTEM, chat, check_greedy
from tests.test_engine_exact import TestMemoryPressure as _Pressure

VIRTUAL = {"kv_layout": "virtual"}
"""The default 128 slots of the default 8192-token context: more than `vm.max_map_count`
would hold at their worst, which admission's mapping budget keeps (test_virtual_budget)."""


@pytest.fixture
def make_engine(model_dir: Path) -> Iterator[Callable[..., object]]:
    """Virtual-layout engines on the default model (or `model`), checked and flushed after the test
    (then no view maps anything). A page size whose blocks are not whole memory pages is
    refused at start-up (tested in tests/worker/test_virtual_kv.py): skipped here."""
    from radixserve import Engine

    engines = []

    def make(model: Path = model_dir, **config):
        if config.get("page_size", 16) % 4:
            pytest.skip("kv_layout='virtual' maps whole memory pages: page_size 4 or more")
        engine = Engine(str(model), **{**ENGINE_TEST_DEFAULTS, **VIRTUAL, **config})
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        assert_blocks_accounted(engine)
        assert engine.worker.pool.mapping_count() == 1, "a view still maps a block after flush"
        engine.shutdown()


@pytest.fixture(scope="module")
def engine(model_dir: Path):
    from radixserve import Engine

    eng = Engine(str(model_dir), **ENGINE_TEST_DEFAULTS, **VIRTUAL)
    yield eng
    assert_blocks_accounted(eng)
    eng.shutdown()


class TestVirtualExact(_Exact):
    test_batch_of_16_mixed_lengths = None  # batch mixes: the tiny tests and the cascade's


class TestVirtualChunking(_Chunking):
    pass


class TestVirtualPressure(_Pressure):
    pass


class TestVirtualLogprobs(_Logprobs):
    pass


class TestVirtualCascade(_Cascade):
    """n = 4 and a DSL fork (the others of the class run in the paged layout only)."""

    test_eight_requests_on_one_system_prompt = None
    test_two_level_tree = None
    test_memory_pressure = None


class TestVirtualTriton:
    """The Triton kernels over the views (interpreted here: slow, so one case) against
    transformers: each sequence's KV and each shared run read as one contiguous range. On a
    tiny random Llama with the default model's attention shape (9 query heads over 3 KV heads
    of 64, so its 16-token blocks are whole memory pages as the default model's are), in 2
    layers instead of 30: the interpreter's cost is per layer, the kernels' cases are not."""

    def test_shared_system_prompt_matches_transformers(self, make_engine, tmp_path_factory,
                                                       tokenizer):
        pytest.importorskip("triton")
        from radixserve.worker.attention.triton_backend import interpreting

        if not interpreting():
            pytest.skip("the Triton kernels run on the CPU only with TRITON_INTERPRET=1")
        model = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models",
                               hidden_size=576, num_heads=9, num_kv_heads=3)
        hf = HFReference(model)
        engine = make_engine(model, attention_backend="triton", cascade_min_shared_tokens=16,
                             cascade_min_group_size=2, cascade_cost_model=False)
        # Prefill is the slow part under the interpreter: a system prompt of ~30 tokens,
        # whose two pages two questions share.
        system = SYSTEM[:SYSTEM.index("Always")]
        prompts = [chat(tokenizer, q, system) for q in QUESTIONS[:2]]
        check_greedy(engine, hf, prompts[:1], 1, "caching the system prompt")
        begin, tree_steps = engine.worker.backend.begin_forward, []

        def spy(meta):
            tree_steps.append(meta.cascade is not None)
            begin(meta)

        engine.worker.backend.begin_forward = spy
        check_greedy(engine, hf, prompts, 4, "virtual + triton")
        assert sum(tree_steps) >= 3, "the decodes did not take tree attention's path"
