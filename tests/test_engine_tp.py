"""Tensor parallelism (`tp_size`): every family's sharded model gives transformers' greedy
tokens and logprobs, with KV heads split (N = 2) and replicated (N = 4 > 2 KV heads), through
chunked prefill, eviction, the prefix cache off, forks, beams, tree attention, the virtual
layout and the Triton kernels; the default model at N = 3 (9 query heads, 3 KV heads); and
shapes that do not divide are refused before anything loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixserve import Engine
from tests.conftest import checked_engine
from tests.factories import tiny_model_dir
from tests.hf_reference import HFReference, assert_matches_reference
from tests.test_engine_exact import QUESTIONS, SYSTEM, chat

LOGPROB_TOL = 1e-4
SHAPE = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128)
FAMILIES = {
    "llama": dict(family="llama"),
    "qwen2": dict(family="qwen2"),
    "qwen3": dict(family="qwen3", head_dim=32, tie_word_embeddings=False),
    "mistral": dict(family="mistral", sliding_window=32),
}
BASE = list(range(1000, 1060))
PROMPTS = [BASE[:40], BASE, [7, 8, 9] + BASE[3:50], BASE[:40] + [5, 6]]
"""Shared prefixes (40 tokens: several pages), one unrelated prompt, past the window."""
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
_refs: dict[Path, HFReference] = {}


def reference(model_dir: Path) -> HFReference:
    if model_dir not in _refs:
        _refs[model_dir] = HFReference(model_dir)
    return _refs[model_dir]


def family_dir(tmp_path_factory, name: str) -> Path:
    return tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models",
                          **{**SHAPE, **FAMILIES[name]})


def assert_logprobs(res: dict, ids: list[int], ref: HFReference) -> None:
    """Every prompt and output token's logprob within LOGPROB_TOL of transformers'."""
    full = ids + res["output_ids"]
    lp = ref.logprobs(full)
    meta = res["meta_info"]
    for pos, (value, token, _) in enumerate(meta["input_token_logprobs"][1:], start=1):
        assert abs(value - float(lp[pos - 1, token])) < LOGPROB_TOL, (pos, value)
    for k, (value, token, _) in enumerate(meta["output_token_logprobs"]):
        assert abs(value - float(lp[len(ids) + k - 1, token])) < LOGPROB_TOL, (k, value)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_sharded_equals_transformers(tmp_path_factory, name, tp):
    """Small pages and chunks, a pool that evicts: the shared prefixes are cached, evicted
    and read again on every rank alike."""
    model_dir = family_dir(tmp_path_factory, name)
    ref = reference(model_dir)
    with checked_engine(model_dir, tp_size=tp, page_size=4, chunked_prefill_size=16,
                        max_total_tokens=160, debug_invariants=True) as engine:
        assert engine.model_info()["tp_size"] == tp
        results = [engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True,
                                   logprob_start_len=0) for ids in PROMPTS]
        for i, (ids, res) in enumerate(zip(PROMPTS, results)):
            assert_matches_reference(res["output_ids"], ref.greedy(ids, 10), f"{name} #{i}")
            assert_logprobs(res, ids, ref)
        batch = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [r["output_ids"] for r in batch] == [r["output_ids"] for r in results]
        assert engine.stats()["evicted_tokens"] > 0


@pytest.mark.parametrize("config", [
    {"enable_prefix_cache": False},
    {"kv_layout": "virtual", "page_size": 16},
    {"attention_backend": "triton"},
    {"enable_cascade_attention": True, "cascade_min_shared_tokens": 8,
     "cascade_min_group_size": 2},
], ids=["nocache", "virtual", "triton", "cascade"])
def test_attention_paths_per_rank(tmp_path_factory, config):
    """Each rank runs the configured KV layout and kernels on its own heads."""
    model_dir = family_dir(tmp_path_factory, "llama")
    ref = reference(model_dir)
    with checked_engine(model_dir, tp_size=2, max_total_tokens=2048, debug_invariants=True,
                        **config) as engine:
        out = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        for i, (ids, res) in enumerate(zip(PROMPTS, out)):
            assert_matches_reference(res["output_ids"], ref.greedy(ids, 10), f"#{i}")


@pytest.fixture(scope="module")
def tp3(model_dir):
    """The default model over 3 ranks: 3 query heads and one KV head each."""
    with checked_engine(model_dir, tp_size=3, max_total_tokens=4096,
                        debug_invariants=True) as engine:
        yield engine


class TestDefaultModelOverThreeRanks:
    def test_greedy_and_logprobs_equal_transformers(self, tp3, hf, tokenizer):
        prompts = [chat(tokenizer, q, system=SYSTEM) for q in QUESTIONS[:3]]
        out = tp3.generate(input_ids=prompts, sampling_params=dict(GREEDY, max_new_tokens=12),
                           return_logprob=True, logprob_start_len=0)
        for i, (ids, res) in enumerate(zip(prompts, out)):
            assert_matches_reference(res["output_ids"], hf.greedy(ids, 12), f"#{i}")
            assert_logprobs(res, ids, hf)

    def test_forks_and_beams(self, tp3, hf, tokenizer):
        ids = tokenizer.encode("The capital of France is")
        forks = tp3.generate(input_ids=ids, sampling_params=dict(GREEDY, n=3))
        want = hf.greedy(ids, 10)
        for fork in forks:
            assert_matches_reference(fork["output_ids"], want, "fork")
        beams = tp3.beam_search(input_ids=ids, beam_width=2, max_new_tokens=8)
        expected = hf.beam_search(ids, 2, 8)
        assert [b["output_ids"] for b in beams] == [tokens for tokens, _ in expected]
        for b, (_, score) in zip(beams, expected):
            assert b["meta_info"]["beam_score"] == pytest.approx(score, abs=1e-4)


@pytest.mark.parametrize("shape, tp, dimension", [
    (dict(num_heads=4, num_kv_heads=2), 3, "num_attention_heads"),
    (dict(num_heads=6, num_kv_heads=3, hidden_size=96), 2, "num_key_value_heads"),
    (dict(intermediate_size=130), 4, "intermediate_size"),
])
def test_a_dimension_that_does_not_divide_is_named(tmp_path_factory, shape, tp, dimension):
    model_dir = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models",
                               **{**SHAPE, **shape})
    with pytest.raises(ValueError, match=dimension):
        Engine(str(model_dir), tp_size=tp)


def test_options_are_checked():
    with pytest.raises(ValueError, match="dist_init_addr"):
        Engine(nnodes=2, tp_size=2)
    with pytest.raises(ValueError, match="node_rank"):
        Engine(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="127.0.0.1:1234")
    with pytest.raises(ValueError, match="tp_size"):
        Engine(tp_size=3, nnodes=2, dist_init_addr="127.0.0.1:1234")
