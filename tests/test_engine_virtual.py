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
from tests.test_engine_api import TestLogprobs as _Logprobs
from tests.test_engine_cascade import TestCascadeAgainstTransformers as _Cascade
from tests.test_engine_cascade import plans  # noqa: F401  (a fixture the cascade tests use)
from tests.test_engine_exact import TestAgainstTransformers as _Exact
from tests.test_engine_exact import TestChunkingAndPaging as _Chunking
from tests.test_engine_exact import TestMemoryPressure as _Pressure

VIRTUAL = {"kv_layout": "virtual", "max_running_requests": 32}
"""32 slots: the default 128 at the default model's 8192-token context could need more
memory mappings than this kernel allows (see test_virtual_kv's refusal)."""


@pytest.fixture
def make_engine(model_dir: Path) -> Iterator[Callable[..., object]]:
    """Virtual-layout engines on the default model, checked and flushed after the test
    (then no view maps anything). A page size whose blocks are not whole memory pages is
    refused at start-up (tested in tests/worker/test_virtual_kv.py): skipped here."""
    from radixserve import Engine

    engines = []

    def make(**config):
        if config.get("page_size", 16) % 4:
            pytest.skip("kv_layout='virtual' maps whole memory pages: page_size 4 or more")
        engine = Engine(str(model_dir), **{**ENGINE_TEST_DEFAULTS, **VIRTUAL, **config})
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
