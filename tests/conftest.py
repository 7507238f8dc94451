"""Shared fixtures: the default model, the transformers reference, engines that are checked
for the KV-block invariant after every test."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import pytest

from tests.factories import default_model_dir
from tests.hf_reference import HFReference

ENGINE_TEST_DEFAULTS = {"max_total_tokens": 8192, "debug_invariants": True}


def assert_blocks_accounted(engine, flush: bool = True) -> None:
    """Idle engine: every block free or cached and unlocked; after a flush, all free."""
    engine.check_invariants()
    s = engine.stats()
    assert s["running"] == 0 and s["waiting"] == 0, s
    assert s["locked_blocks"] == 0, f"{s['locked_blocks']} blocks still locked while idle"
    assert s["free_blocks"] + s["evictable_blocks"] == s["num_blocks"], s
    if flush:
        assert engine.flush_cache()
        s = engine.stats()
        assert s["free_blocks"] == s["num_blocks"], f"block leak after flush: {s}"


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return default_model_dir()


@pytest.fixture(scope="session")
def hf(model_dir: Path) -> HFReference:
    return HFReference(model_dir)


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path):
    from radixserve.model.loader import load_tokenizer
    return load_tokenizer(model_dir)


@pytest.fixture
def make_engine(model_dir: Path) -> Iterator[Callable[..., object]]:
    """Build engines on the default model; each is checked and flushed after the test."""
    from radixserve import Engine

    engines = []

    def make(**config):
        engine = Engine(str(model_dir), **{**ENGINE_TEST_DEFAULTS, **config})
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        assert_blocks_accounted(engine)
        engine.shutdown()


@pytest.fixture(scope="module")
def engine(model_dir: Path):
    """One engine with the default configuration, shared by a module's tests."""
    from radixserve import Engine

    eng = Engine(str(model_dir), **ENGINE_TEST_DEFAULTS)
    yield eng
    assert_blocks_accounted(eng)
    eng.shutdown()


@pytest.fixture(autouse=True)
def _shared_engine_invariant(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "engine" in request.fixturenames:
        assert_blocks_accounted(request.getfixturevalue("engine"), flush=False)
