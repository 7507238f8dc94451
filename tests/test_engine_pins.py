"""Pins and the cache view through the Engine (tiny random-weight model, real tokenizer,
a small pool): a pinned prefix survives a flood that evicts everything else and is a hit
on re-use; ttl expiry; unpin; the bound; salts keep pins apart; cache_info shows the
prefixes that were sent, with their text. The block invariant after every scenario."""

from __future__ import annotations

import time

import pytest

from radixserve import Engine
from tests.conftest import assert_blocks_accounted
from tests.factories import tiny_model_dir

GREEDY = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
SYSTEM = ("You are a careful assistant for the lighthouse keepers of the northern coast. "
          "Answer briefly, name the lamp and the tide, and never guess a weather report. ") * 3


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tiny = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")
    # 24 pages of 16: a pinned ~100-token prefix plus room for one or two others.
    eng = Engine(str(tiny), max_total_tokens=384, page_size=16, debug_invariants=True,
                 max_pinned_tokens=160, chunked_prefill_size=256)
    yield eng
    eng.shutdown()


def other(i: int) -> str:
    return f"Request {i}: " + " ".join(f"word{i}x{j}" for j in range(60))


@pytest.fixture(autouse=True)
def accounted(engine):
    yield
    engine.unpin_all()  # a test's leftovers
    assert_blocks_accounted(engine)


class TestPinPrefix:
    def test_pinned_prefix_survives_a_flood(self, engine) -> None:
        pin = engine.pin_prefix(SYSTEM)
        pinned = pin["tokens"]
        assert pinned >= 64 and pin["tier"] == "memory" and pin["expires_in"] is None
        for i in range(6):  # ~130 tokens each, in a pool of 384: everything else goes
            engine.generate(other(i), GREEDY)
        assert engine.stats()["evicted_tokens"] > 0
        out = engine.generate(SYSTEM + " Which lamp?", GREEDY)
        assert out["meta_info"]["cached_tokens"] >= pinned
        assert out["meta_info"]["cached_tokens_details"] == {
            "memory": out["meta_info"]["cached_tokens"], "disk": 0}
        assert engine.flush_cache() and engine.stats()["cached_tokens"] == pinned
        assert engine.unpin_prefix(SYSTEM)["unpinned"]
        assert not engine.unpin_prefix(SYSTEM)["unpinned"]

    def test_ttl_expires(self, engine) -> None:
        assert engine.pin_prefix(SYSTEM, ttl=0.2)["expires_in"] <= 0.2
        assert engine.stats()["pinned_tokens"] > 0
        time.sleep(0.25)
        engine.generate("tick", GREEDY)  # a step expires it
        assert engine.stats()["pinned_tokens"] == 0

    def test_bound_names_the_flag(self, engine) -> None:
        engine.pin_prefix(SYSTEM)
        with pytest.raises(ValueError, match="--max-pinned-tokens"):
            engine.pin_prefix(other(1))

    def test_salts_keep_pins_apart(self, engine) -> None:
        engine.pin_prefix(input_ids=list(range(100, 164)), cache_salt="a")
        assert not engine.unpin_prefix(input_ids=list(range(100, 164)))["unpinned"]
        assert not engine.unpin_prefix(input_ids=list(range(100, 164)),
                                       cache_salt="b")["unpinned"]
        out = engine.generate(input_ids=list(range(100, 170)), sampling_params=GREEDY,
                              cache_salt="b")
        assert out["meta_info"]["cached_tokens"] == 0
        assert engine.unpin_prefix(input_ids=list(range(100, 164)),
                                   cache_salt="a")["unpinned"]

    def test_bad_ttl_and_batches_are_refused(self, engine) -> None:
        with pytest.raises(ValueError, match="ttl"):
            engine.pin_prefix(SYSTEM, ttl=0)
        with pytest.raises(ValueError, match="batch"):
            engine.pin_prefix([SYSTEM, SYSTEM])  # type: ignore[arg-type]


class TestCacheInfo:
    def test_shows_the_prefixes_sent(self, engine) -> None:
        engine.flush_cache()
        for q in ("Which lamp?", "Which tide?"):
            engine.generate(SYSTEM + q, GREEDY)
        engine.pin_prefix(SYSTEM)
        info = engine.cache_info(top=10)
        first = [n for n in info["nodes"] if n["parent"] is None]
        assert any(n["text"].startswith("You are a careful assistant") and n["pinned"]
                   and n["hits"] >= 1 and n["tier"] == "memory" for n in first), info
        assert info["totals"]["memory"]["tokens"] == engine.stats()["cached_tokens"]
        assert info["pins"][0]["text"].startswith("You are a careful")
        assert all(n["last_use"] <= time.time() for n in info["nodes"])
