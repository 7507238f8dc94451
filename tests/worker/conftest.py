"""The worker tests' fixtures: `fake_cuda`, the driver of `fake_cuda.py` in place of
`cuda.bindings.driver`."""

from __future__ import annotations

import gc
import sys
import types
from collections.abc import Iterator

import pytest

from tests.worker.fake_cuda import FakeDriver


@pytest.fixture
def fake_cuda(monkeypatch) -> Iterator[FakeDriver]:
    driver = FakeDriver()
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = driver
    monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    yield driver
    gc.collect()  # the test's pools are freed (and checked) through this driver


