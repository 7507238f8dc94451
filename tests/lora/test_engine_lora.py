"""Multi-LoRA serving against transformers + PEFT: one batch mixing three adapters (made by
PEFT here: random A and B, several ranks and target sets) and the base model gives every
request PEFT's own greedy output, with the cache on, chunked prefills and eviction; and the
prefix cache is keyed by adapter (lora/adapter.py, scheduler/loras.py)."""

from __future__ import annotations

import json
import random

import pytest

from radixserve.config import EngineConfig
from tests.conftest import ENGINE_TEST_DEFAULTS, checked_engine
from tests.lora.adapters import peft_greedy

MAX_NEW = 12


def prompts(n: int, shared: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(100, 3000) for _ in range(shared)]
    return [system + [rng.randrange(100, 3000) for _ in range(5 + i % 7)] for i in range(n)]


def test_mixed_batch_equals_peft(tiny, adapters):
    """Three adapters and the base in one batch, cache on, prefills chunked, a pool small
    enough to evict: each request's greedy output is transformers + PEFT's."""
    names = [None, "qv", "all", "mlp"]
    ids = prompts(12, shared=40)
    which = [names[i % 4] for i in range(len(ids))]
    params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    paths = [f"{n}={p}" for n, p in adapters.items()]
    with checked_engine(tiny, **{**ENGINE_TEST_DEFAULTS, "max_total_tokens": 512},
                        lora_paths=paths, chunked_prefill_size=32, page_size=4) as engine:
        first = engine.generate(input_ids=ids, sampling_params=params, lora_name=which)
        again = engine.generate(input_ids=ids, sampling_params=params, lora_name=which)
        stats = engine.stats()
    assert stats["evicted_tokens"] > 0  # the pool was too small: eviction happened
    for prompt, name, a, b in zip(ids, which, first, again):
        want = peft_greedy(tiny, None if name is None else adapters[name], prompt, MAX_NEW)
        assert a["output_ids"] == want, name
        assert b["output_ids"] == want, name
    outs = {name: first[i]["output_ids"] for i, name in enumerate(which[:4])}
    assert len({tuple(o) for o in outs.values()}) == 4  # each adapter changes the answer


def test_cache_keyed_by_adapter(tiny, adapters):
    """The same prompt under two adapters shares no KV; under one it does; the base's KV is
    never an adapter's."""
    ids = prompts(1, shared=48)[0]
    params = {"max_new_tokens": 2, "temperature": 0}
    paths = [f"{n}={p}" for n, p in adapters.items()]
    with checked_engine(tiny, **ENGINE_TEST_DEFAULTS, lora_paths=paths, page_size=4) as engine:
        cached = [engine.generate(input_ids=ids, sampling_params=params,
                                  lora_name=name)["meta_info"]["cached_tokens"]
                  for name in ("qv", "all", "qv", None, "all")]
    assert cached[:2] == [0, 0]
    assert cached[2] >= 44  # the same adapter: its prefix is cached
    assert cached[3] == 0  # the base model: none of the adapters' KV
    assert cached[4] >= 44


def test_unknown_adapter_is_refused(tiny, adapters):
    with checked_engine(tiny, **ENGINE_TEST_DEFAULTS,
                        lora_paths=[f"qv={adapters['qv']}"]) as engine:
        with pytest.raises(ValueError, match=r"unknown LoRA adapter 'nope'.*loaded: qv"):
            engine.generate(input_ids=[1, 2, 3], lora_name="nope")
    with checked_engine(tiny, **ENGINE_TEST_DEFAULTS) as engine:
        with pytest.raises(ValueError, match="serves no LoRA adapters"):
            engine.generate(input_ids=[1, 2, 3], lora_name="qv")


def test_a_failed_step_leaves_no_slot_unfilled(tiny, adapters, monkeypatch):
    """A step that fails before its adapter fills ran leaves the worker's slots unknown:
    the next step fills them again (`AdapterSlot.reset`), so the adapter still applies."""
    from radixserve.worker.worker import Worker

    ids = prompts(1, shared=20)[0]
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    real, armed = Worker._plan, [True]

    def fail_once(self, step):
        if armed[0]:  # before the step's fills (`LoraSlots.begin`): the slot stays empty
            armed[0] = False
            raise RuntimeError("injected worker failure")
        return real(self, step)

    monkeypatch.setattr(Worker, "_plan", fail_once)
    with checked_engine(tiny, **ENGINE_TEST_DEFAULTS, page_size=4,
                        lora_paths=[f"qv={adapters['qv']}"]) as engine:
        failed = engine.generate(input_ids=ids, sampling_params=params, lora_name="qv")
        again = engine.generate(input_ids=ids, sampling_params=params, lora_name="qv")
    assert failed["meta_info"]["finish_reason"]["type"] == "abort"
    assert again["output_ids"] == peft_greedy(tiny, adapters["qv"], ids, 4)


@pytest.mark.parametrize("form", ["dict", "json", "object"])
def test_sglang_s_forms_of_lora_paths(tiny, adapters, form):
    """SGLang's forms of `lora_paths`: its Engine's dict `{name: path}`, its CLI's JSON
    text and the object itself `{"lora_name", "lora_path"}`; each loads the adapter under
    its name (PEFT's answer), and `pinned: true`, which radixserve does not take, is
    refused by name."""
    ref = {"lora_name": "qv", "lora_path": str(adapters["qv"])}
    paths = {"dict": {"qv": str(adapters["qv"])}, "json": [json.dumps(ref)],
             "object": [ref]}[form]
    ids = prompts(1, shared=20)[0]
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    with checked_engine(tiny, **ENGINE_TEST_DEFAULTS, lora_paths=paths) as engine:
        out = engine.generate(input_ids=ids, sampling_params=params, lora_name="qv")
    assert out["output_ids"] == peft_greedy(tiny, adapters["qv"], ids, 4)
    with pytest.raises(ValueError, match="pinned is not supported"):
        EngineConfig.from_kwargs(model=str(tiny), lora_paths=[{**ref, "pinned": True}])
