"""Shared fixtures: the default model, the transformers reference, engines that are checked
for the KV-block invariant after every test."""

from __future__ import annotations

import importlib
import os
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

import pytest

from tests.factories import default_model_dir
from tests.hf_reference import HFReference

ENGINE_TEST_DEFAULTS = {"max_total_tokens": 8192, "debug_invariants": True}


def require(module: str) -> ModuleType:
    """`module` imported: a client the tests drive the server with (sglang, openai). Where
    it is missing, a developer's run skips the test, and CI's (`CI` set, as CI services
    set it) fails it naming the module: scripts/setup.sh installs it there, so its absence
    is a broken set-up, never a reason to test less."""
    if os.environ.get("CI", "").lower() in ("", "0", "false"):
        return pytest.importorskip(module)
    try:
        return importlib.import_module(module)
    except ImportError as e:
        pytest.fail(f"{module} is missing under CI (scripts/setup.sh installs it): {e}",
                    pytrace=False)


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


ABORT_RACE_PARAMS = {"max_new_tokens": 64, "ignore_eos": True, "temperature": 0}
"""What `assert_abort_ends_only_its_rid` runs: long enough to be aborted mid-way."""


def assert_abort_ends_only_its_rid(generate: Callable[[str], dict], running: Callable[[], int],
                                   abort: Callable[[str], Any], rids: list[str]) -> None:
    """Run `generate(rid)` (returning a result's `meta_info`, with `ABORT_RACE_PARAMS`) for
    `rids` = [a, b] at once, `abort(a)` once both run: a ends aborted mid-way, b (a rid that
    merely starts with a, such as "a:b") runs to its length."""
    out: dict[str, Any] = {}

    def run(rid: str) -> None:
        try:
            out[rid] = generate(rid)
        except BaseException as e:  # re-raised below, in the test's thread
            out[rid] = e

    threads = [threading.Thread(target=run, args=(rid,)) for rid in rids]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while running() < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    abort(rids[0])
    for t in threads:
        t.join(120)
    for result in out.values():
        if isinstance(result, BaseException):
            raise result
    aborted, other = (out[r] for r in rids)
    # Aborted mid-way: the two ran in lockstep, so b was running when the abort landed.
    assert aborted["finish_reason"]["type"] == "abort"
    assert aborted["completion_tokens"] < 64, aborted
    assert other["finish_reason"] == {"type": "length", "length": 64}, other
    assert other["completion_tokens"] == 64


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


@contextmanager
def checked_engine(model_dir: str | Path, **config: Any) -> Iterator[Any]:
    """An engine on `model_dir`, as `with Engine(...)`; when the block ends without an
    error, `assert_blocks_accounted` (flushed) before it shuts down. Every engine a test
    or fixture builds is built with this."""
    from radixserve import Engine

    with Engine(str(model_dir), **config) as engine:
        yield engine
        assert_blocks_accounted(engine)


@pytest.fixture
def make_engine(model_dir: Path) -> Iterator[Callable[..., object]]:
    """Build engines on the default model; each is checked and flushed after the test."""
    with ExitStack() as engines:
        yield lambda **config: engines.enter_context(
            checked_engine(model_dir, **{**ENGINE_TEST_DEFAULTS, **config}))


@pytest.fixture(scope="module")
def engine(model_dir: Path):
    """One engine with the default configuration, shared by a module's tests."""
    with checked_engine(model_dir, **ENGINE_TEST_DEFAULTS) as eng:
        yield eng


@pytest.fixture(autouse=True)
def _shared_engine_invariant(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "engine" in request.fixturenames:
        assert_blocks_accounted(request.getfixturevalue("engine"), flush=False)
