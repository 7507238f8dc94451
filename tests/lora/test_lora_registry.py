"""Adapters loaded and unloaded while serving (scheduler/loras.py): the bounded set with its
least-recently-used eviction, refusals that leave everything running alone, a different file
reloaded under the same name (new fingerprint: no stale KV), and a warm restart from the
disk tier that keeps each adapter's prefixes its own."""

from __future__ import annotations

import pytest

from radixserve import Engine
from tests.conftest import ENGINE_TEST_DEFAULTS, assert_blocks_accounted, checked_engine
from tests.lora.adapters import peft_adapter, peft_greedy
from tests.lora.test_engine_lora import prompts

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    """Three adapters alike but for their random weights (conftest's, overridden)."""
    root = tmp_path_factory.mktemp("adapters")
    return [peft_adapter(tiny, root, seed=i, scale=30.0) for i in range(3)]


def test_load_unload_and_lru(tiny, adapters, tmp_path):
    ids = prompts(1, shared=20)[0]
    with checked_engine(tiny, **ENGINE_TEST_DEFAULTS, enable_lora=True, max_loaded_loras=2,
                        max_loras_per_batch=1) as engine:
        assert engine.list_lora_adapters() == []
        a = engine.load_lora_adapter("a", str(adapters[0]))
        assert a["unloaded"] == [] and a["rank"] == 8
        engine.load_lora_adapter("b", str(adapters[1]))
        with pytest.raises(ValueError, match="'a' is already loaded"):
            engine.load_lora_adapter("a", str(adapters[2]))
        engine.generate(input_ids=ids, sampling_params=GREEDY, lora_name="a")  # a: used last
        c = engine.load_lora_adapter("c", str(adapters[2]))
        assert c["unloaded"] == ["b"]  # the least recently used
        assert [x["name"] for x in engine.list_lora_adapters()] == ["a", "c"]
        with pytest.raises(ValueError, match=r"unknown LoRA adapter 'b'; loaded: a, c"):
            engine.generate(input_ids=ids, lora_name="b")
        with pytest.raises(ValueError, match="no readable PEFT adapter config"):
            engine.load_lora_adapter("d", str(tmp_path / "nowhere"))
        with pytest.raises(ValueError, match="a LoRA adapter name is"):
            engine.load_lora_adapter("no spaces", str(adapters[0]))
        assert [x["name"] for x in engine.list_lora_adapters()] == ["a", "c"]  # kept
        for name, path in (("a", adapters[0]), ("c", adapters[2])):
            out = engine.generate(input_ids=ids, sampling_params=GREEDY, lora_name=name)
            assert out["output_ids"] == peft_greedy(tiny, path, ids, 6)
        engine.unload_lora_adapter("a")
        with pytest.raises(ValueError, match="unknown LoRA adapter 'a'"):
            engine.unload_lora_adapter("a")


def test_a_running_adapter_is_not_evicted_and_the_operators_unload_ends_its_requests(
        tiny, adapters):
    """Evicting an adapter a request runs under, for a load, is refused; the operator's
    unload is not (issue 53, finding 7): the requests under it end at the next step with
    an abort naming the unload, and the adapter is gone."""
    ids = prompts(1, shared=20)[0]
    with checked_engine(tiny, **ENGINE_TEST_DEFAULTS, enable_lora=True,
                        max_loaded_loras=1, max_loras_per_batch=1) as engine:
        engine.load_lora_adapter("a", str(adapters[0]))
        stream = engine.generate(input_ids=ids, stream=True, lora_name="a", sampling_params={
            **GREEDY, "max_new_tokens": 200})
        next(stream)
        with pytest.raises(ValueError, match="requests use every one"):
            engine.load_lora_adapter("b", str(adapters[1]))
        engine.unload_lora_adapter("a")
        final = [c for c in stream if "final" in c][0]["final"]
        assert final["meta_info"]["finish_reason"] == {
            "type": "abort", "message": "the operator unloaded LoRA adapter 'a'"}
        assert len(final["output_ids"]) < 200
        assert final["output_ids"] == peft_greedy(tiny, adapters[0], ids,
                                                  len(final["output_ids"]))
        assert engine.list_lora_adapters() == []
        engine.load_lora_adapter("b", str(adapters[1]))  # the place is free again


def test_reloading_another_file_under_a_name(tiny, adapters):
    """The cache is keyed by the weights' fingerprint: the same file again reuses its KV,
    another file under the same name does not."""
    ids = prompts(1, shared=32)[0]
    with checked_engine(tiny, **ENGINE_TEST_DEFAULTS, enable_lora=True, page_size=4) as engine:
        def cached(path) -> int:
            engine.load_lora_adapter("x", str(path))
            out = engine.generate(input_ids=ids, sampling_params=GREEDY, lora_name="x")
            engine.unload_lora_adapter("x")
            assert out["output_ids"] == peft_greedy(tiny, path, ids, 6)
            return out["meta_info"]["cached_tokens"]

        assert cached(adapters[0]) == 0
        assert cached(adapters[0]) >= 28
        assert cached(adapters[1]) == 0


def test_warm_restart_keeps_adapters_apart(tiny, adapters, tmp_path):
    """A restart on the same disk tier: a prompt's KV under adapter a comes back for a, and
    neither for adapter b nor the base."""
    ids = prompts(1, shared=32)[0]
    options = dict(ENGINE_TEST_DEFAULTS, page_size=4, kv_disk_dir=str(tmp_path / "kv"),
                   lora_paths=[f"a={adapters[0]}", f"b={adapters[1]}"])
    with Engine(str(tiny), **options) as engine:  # closed unflushed: the cache stays
        engine.generate(input_ids=ids, sampling_params=GREEDY, lora_name="a")
        assert_blocks_accounted(engine, flush=False)
    with checked_engine(tiny, **options) as engine:
        cached = {name: engine.generate(input_ids=ids, sampling_params=GREEDY,
                                        lora_name=name)["meta_info"]
                  for name in ("b", None, "a")}
    assert cached["b"]["cached_tokens"] == 0 and cached[None]["cached_tokens"] == 0
    assert cached["a"]["cached_tokens_details"]["disk"] >= 28, cached["a"]


def test_loads_under_tensor_parallelism(tiny, adapters, tmp_path):
    """Every rank reads the adapter (its cut); a bad one is refused on every rank and the
    group serves on."""
    ids = prompts(1, shared=20)[0]
    with checked_engine(tiny, **ENGINE_TEST_DEFAULTS, enable_lora=True, tp_size=2) as engine:
        with pytest.raises(ValueError, match="no readable PEFT adapter config"):
            engine.load_lora_adapter("bad", str(tmp_path / "nowhere"))
        engine.load_lora_adapter("a", str(adapters[0]))
        out = engine.generate(input_ids=ids, sampling_params=GREEDY, lora_name="a")
        assert out["output_ids"] == peft_greedy(tiny, adapters[0], ids, 6)
