"""Fixtures of the DSL tests: a backend on the module's shared Engine."""

from __future__ import annotations

import pytest

import radixserve.lang as sgl


@pytest.fixture(scope="module")
def backend(engine):
    """An EngineBackend over the shared engine, also the default backend; stats reset."""
    be = sgl.EngineBackend(engine)
    previous = sgl.get_default_backend()
    sgl.set_default_backend(be)
    yield be
    from radixserve.lang.backends import _default
    _default[0] = previous  # the engine goes with the module: do not leave it the default


@pytest.fixture
def fresh(backend, engine):
    """The backend with its counters reset and the runtime cache flushed."""
    assert engine.flush_cache()
    backend.reset_stats()
    return backend
