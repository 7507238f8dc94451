"""Qwen2, Qwen3 and Mistral (sliding window) against transformers, on tiny random models
made with transformers' own config classes, and the config checks that refuse what the
decoder does not implement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from radixserve.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from tests.conftest import checked_engine
from tests.factories import default_model_dir, tiny_model_dir
from tests.gguf_files import write_gguf
from tests.hf_reference import HFReference, assert_matches_reference

WINDOW = 32
SHAPE = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128)
FAMILIES = {
    "qwen2": dict(family="qwen2"),
    # head_dim 32 is not hidden_size / num_heads, as in the real Qwen3 models.
    "qwen3": dict(family="qwen3", head_dim=32, tie_word_embeddings=False),
    "mistral_window": dict(family="mistral", num_kv_heads=1, sliding_window=WINDOW),
    "qwen2_yarn": dict(family="qwen2", rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    # Qwen2's own windows: only the layers from max_window_layers on slide.
    "qwen2_window": dict(family="qwen2", use_sliding_window=True, sliding_window=WINDOW,
                         max_window_layers=1),
}
BASE = list(range(1000, 1070))
PROMPTS = [BASE[:5], BASE[:40], BASE, [7, 8, 9] + BASE[3:50]]
"""5, 40 and 70 tokens (past the window by 8 and 38), the 40 a prefix of the 70, and 50
that share no prefix with them."""
NEW = 12
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}


def family_dir(tmp_path_factory, name: str) -> Path:
    return tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models",
                          **{**SHAPE, **FAMILIES[name]})


_refs: dict[str, HFReference] = {}


def reference(model_dir: Path) -> HFReference:
    key = str(model_dir)
    if key not in _refs:
        _refs[key] = HFReference(model_dir)
    return _refs[key]


@pytest.mark.parametrize("engine_options", [
    dict(page_size=1, chunked_prefill_size=16),
    dict(page_size=16, chunked_prefill_size=16),
    dict(page_size=16, chunked_prefill_size=512, enable_prefix_cache=False),
], ids=["page1_chunk16", "page16_chunk16", "page16_nocache"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_matches_transformers(tmp_path_factory, name, engine_options):
    model_dir = family_dir(tmp_path_factory, name)
    hf = reference(model_dir)
    with checked_engine(model_dir, max_total_tokens=2048, debug_invariants=True,
                        **engine_options) as engine:
        # One at a time, so the 70-token prompt finds the 40 in the cache; then all at once
        # (mixed prefill and decode steps, every prompt cached).
        cached = []
        for ids in PROMPTS:
            res = engine.generate(input_ids=ids, sampling_params=GREEDY)
            assert_matches_reference(res["output_ids"], hf.greedy(ids, NEW), f"{name} {ids[:3]}")
            cached.append(res["meta_info"]["cached_tokens"])
        if engine_options.get("enable_prefix_cache", True):
            assert cached[2] >= 32, cached  # BASE[:40] (and its output) was reused
        for ids, res in zip(PROMPTS, engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)):
            assert_matches_reference(res["output_ids"], hf.greedy(ids, NEW), f"{name} batched")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logprobs_match_transformers(tmp_path_factory, name):
    model_dir = family_dir(tmp_path_factory, name)
    hf = reference(model_dir)
    ids = PROMPTS[2]
    with checked_engine(model_dir, max_total_tokens=1024, page_size=4, chunked_prefill_size=24,
                        debug_invariants=True) as engine:
        res = engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True,
                              logprob_start_len=0)
    out = res["output_ids"]
    assert_matches_reference(out, hf.greedy(ids, NEW), name)
    full = hf.logprobs(ids + out)
    meta = res["meta_info"]
    got_in = [lp for lp, _, _ in meta["input_token_logprobs"] if lp is not None]
    want_in = [float(full[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert len(got_in) == len(want_in)
    torch.testing.assert_close(torch.tensor(got_in), torch.tensor(want_in), atol=1e-4, rtol=0)
    got_out = [lp for lp, _, _ in meta["output_token_logprobs"]]
    want_out = [float(full[len(ids) + j - 1, t]) for j, t in enumerate(out)]
    torch.testing.assert_close(torch.tensor(got_out), torch.tensor(want_out), atol=1e-4, rtol=0)


CASCADE = dict(enable_cascade_attention=True, cascade_min_shared_tokens=16,
               cascade_min_group_size=2, page_size=4, chunked_prefill_size=256,
               cascade_cost_model=False)  # short prompts: the gates alone decide


@pytest.mark.parametrize("name", ["qwen3", "mistral_window"])
def test_shared_prefix_decodes_cascade_or_fall_back(tmp_path_factory, name):
    """Four requests on one 44-token prefix, decoding together past the window: tree
    attention runs for a model without a window, and for one with it no step cascades."""
    model_dir = family_dir(tmp_path_factory, name)
    hf = reference(model_dir)
    prompts = [BASE[:44] + [50 + i, 60 + i] for i in range(4)]
    with checked_engine(model_dir, max_total_tokens=2048, debug_invariants=True,
                        **CASCADE) as engine:
        engine.generate(input_ids=BASE[:44] + [1], sampling_params=GREEDY)  # cache the prefix
        for ids, res in zip(prompts, engine.generate(input_ids=prompts, sampling_params=GREEDY)):
            assert_matches_reference(res["output_ids"], hf.greedy(ids, NEW), f"{name} cascade")
            assert res["meta_info"]["cached_tokens"] >= 40
        steps = engine.stats()["cascade_steps"]
        info = engine.worker.info()
        if "window" in name:  # every context past the window: no step may cascade
            assert steps == 0
            assert (info.architecture, info.sliding_window) == ("MistralForCausalLM", WINDOW)
            assert any("tree attention only in steps" in f for f in info.fallbacks)
        else:
            assert steps > 0
            assert (info.architecture, info.sliding_window, info.fallbacks) == (
                "Qwen3ForCausalLM", None, [])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cascade_runs_while_contexts_fit_the_window(tmp_path_factory, backend):
    """Four requests on one 16-token cached prefix decode together from 18 to 34 tokens:
    tree attention runs in the steps whose contexts all fit the 32-token window, then
    stops; every token is transformers'."""
    model_dir = family_dir(tmp_path_factory, "mistral_window")
    hf = reference(model_dir)
    prefix = BASE[:16]
    prompts = [prefix + [50 + i, 60 + i] for i in range(4)]
    with checked_engine(model_dir, max_total_tokens=1024, debug_invariants=True,
                        attention_backend=backend,
                        **{**CASCADE, "cascade_min_shared_tokens": 8}) as engine:
        engine.generate(input_ids=prefix + [1], sampling_params=GREEDY)  # cache the prefix
        steps = []
        real_forward = engine.worker.forward

        def forward(batch):
            result = real_forward(batch)
            steps.append((max(batch.kv_lens), result.shared_runs))
            return result

        engine.worker.forward = forward
        params = {**GREEDY, "max_new_tokens": 16}
        for ids, res in zip(prompts, engine.generate(input_ids=prompts, sampling_params=params)):
            assert_matches_reference(res["output_ids"], hf.greedy(ids, 16), "cascade window")
        assert any(runs for kv, runs in steps if kv <= WINDOW), steps
        assert not any(runs for kv, runs in steps if kv > WINDOW), steps
        assert any(kv > WINDOW for kv, _ in steps)


def test_triton_backend_honours_the_window(tmp_path_factory):
    """The Triton kernels (interpreted here) read only each query's window: prompts past
    it, chunked, with a cache hit and mixed decode/extend steps, give transformers'
    tokens."""
    model_dir = family_dir(tmp_path_factory, "mistral_window")
    hf = reference(model_dir)
    with checked_engine(model_dir, attention_backend="triton", max_total_tokens=512,
                        page_size=4, chunked_prefill_size=24, debug_invariants=True) as engine:
        from radixserve.worker.attention.triton_backend import TritonAttentionBackend
        assert isinstance(engine.worker.backend, TritonAttentionBackend)
        prompts = [PROMPTS[1], PROMPTS[2]]
        first = engine.generate(input_ids=prompts[0], sampling_params=GREEDY)
        assert_matches_reference(first["output_ids"], hf.greedy(prompts[0], NEW), "triton")
        for ids, res in zip(prompts, engine.generate(input_ids=prompts, sampling_params=GREEDY)):
            assert_matches_reference(res["output_ids"], hf.greedy(ids, NEW), "triton window")
        assert res["meta_info"]["cached_tokens"] >= 32


def test_yarn_rope_with_mscale_matches_transformers(tmp_path_factory):
    """YaRN's other knobs (beta_fast, mscale / mscale_all_dim for the attention factor);
    the plain Qwen form is the `qwen2_yarn` family above. Small original lengths, so the
    ramp bites."""
    rope = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
            "beta_fast": 16, "mscale": 1.0, "mscale_all_dim": 0.5}
    model_dir = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models",
                               **{**SHAPE, "family": "qwen2", "rope_scaling": rope})
    hf = reference(model_dir)
    with checked_engine(model_dir, max_total_tokens=1024, page_size=4, chunked_prefill_size=32,
                        debug_invariants=True) as engine:
        results = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY,
                                  return_logprob=True)
    for ids, res in zip(PROMPTS, results):
        assert_matches_reference(res["output_ids"], hf.greedy(ids, NEW), f"yarn {rope}")
        full = hf.logprobs(ids + res["output_ids"])
        got = [lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]]
        want = [float(full[len(ids) + j - 1, t]) for j, t in enumerate(res["output_ids"])]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)


def test_window_wider_than_the_context_is_full_attention(tmp_path_factory):
    model_dir = family_dir(tmp_path_factory, "mistral_window")
    with checked_engine(model_dir, context_length=WINDOW, max_total_tokens=256) as engine:
        assert engine.worker.model_config.sliding_window is None
        assert engine.worker.fallbacks == [] and engine.worker.cascade is not None


# --- the architecture table and the config checks ---------------------------------------

def _config(**fields) -> dict:
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=64,
                intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)
    return {**base, **fields}


def test_family_options_from_the_config():
    qwen2 = ModelConfig.from_dict(_config(architectures=["Qwen2ForCausalLM"],
                                          sliding_window=4096, use_sliding_window=False))
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm, qwen2.layer_windows) == (
        True, False, False, ())
    qwen3 = ModelConfig.from_dict(_config(architectures=["Qwen3ForCausalLM"], head_dim=32))
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim) == (False, True, 32)
    # Qwen3Config's own defaults where config.json is silent (head_dim 128, not 64 / 4).
    bare = ModelConfig.from_dict(_config(architectures=["Qwen3ForCausalLM"]))
    assert (bare.head_dim, bare.max_position_embeddings) == (128, 32768)
    windowed = ModelConfig.from_dict(_config(architectures=["Qwen3ForCausalLM"],
                                             use_sliding_window=True, sliding_window=8,
                                             layer_types=["full_attention", "sliding_attention"]))
    assert windowed.layer_windows == (None, 8)
    # Without layer_types: the layers from max_window_layers on slide (Qwen2Config's rule).
    by_count = ModelConfig.from_dict(_config(architectures=["Qwen2ForCausalLM"],
                                             num_hidden_layers=3, use_sliding_window=True,
                                             sliding_window=8, max_window_layers=1))
    assert by_count.layer_windows == (None, 8, 8)
    mistral = ModelConfig.from_dict(_config(architectures=["MistralForCausalLM"]))
    assert mistral.layer_windows == (4096, 4096)  # MistralConfig's default window
    assert mistral.for_context(4096).layer_windows == ()
    assert mistral.for_context(8192).sliding_window == 4096
    no_window = ModelConfig.from_dict(_config(architectures=["MistralForCausalLM"],
                                              sliding_window=None))
    assert no_window.layer_windows == ()
    llama = ModelConfig.from_dict(_config(attention_bias=True))
    assert (llama.qkv_bias, llama.o_bias) == (True, True)
    assert ModelConfig.from_dict(_config(architectures=None, model_type="qwen3")).qk_norm


@pytest.mark.parametrize("fields,match", [
    (dict(architectures=["GPT2LMHeadModel"]), "unsupported architecture GPT2LMHeadModel"),
    (dict(architectures=["Qwen2MoeForCausalLM"]), "unsupported architecture Qwen2Moe"),
    (dict(architectures=["Qwen3ForCausalLM"], num_experts=8), "mixture-of-experts"),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 4.0}),
     "rope_scaling type 'longrope'"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "original_max_position"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     "rope_scaling type 'dynamic'"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(sliding_window=16), "LlamaForCausalLM with sliding_window"),
    (dict(architectures=["MistralForCausalLM"], layer_types=["full_attention"] * 2),
     "layer_types"),
    (dict(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=8,
          layer_types=["chunked_attention"] * 2), "layer_types"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
], ids=["gpt2", "qwen2moe", "experts", "longrope", "yarn_without_original", "dynamic", "gelu",
        "llama_window", "mistral_layer_types", "qwen_layer_types", "partial_rope"])
def test_unimplemented_config_is_a_clear_error(fields, match):
    with pytest.raises(ValueError, match=match) as info:
        ModelConfig.from_dict(_config(**fields))
    if "architecture" in match:
        assert all(a in str(info.value) for a in SUPPORTED_ARCHITECTURES)


def test_refused_before_any_weight_is_read(tmp_path: Path):
    """A directory with only a config (no weights at all) fails on the config."""
    (tmp_path / "config.json").write_text(json.dumps(_config(
        architectures=["Qwen3MoeForCausalLM"])))
    from radixserve.worker.worker import Worker
    from radixserve.config import EngineConfig
    with pytest.raises(ValueError, match="unsupported architecture Qwen3MoeForCausalLM"):
        Worker(EngineConfig(), tmp_path)


# --- GGUF files of these families --------------------------------------------------------

@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory):
    """Converted GGUFs go to a temporary cache (the tiny files are new every session)."""
    default_model_dir()  # the real cache's default model, converted before the switch
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RADIXSERVE_CACHE", str(tmp_path_factory.mktemp("gguf-cache")))
        yield


@pytest.mark.parametrize("name", ["qwen2_yarn", "qwen3", "mistral_window"])
def test_gguf_of_each_family_matches_transformers(tmp_path_factory, gguf_cache, name):
    """A GGUF written from the tiny model as llama.cpp lays it out (Mistral as `llama`,
    q/k rows interleaved, its window in `llama.attention.sliding_window`; Qwen2's yarn in
    `qwen2.rope.scaling.*`, which transformers' reader drops) converts back to the same
    weights and config, and runs exactly as transformers runs the original."""
    from safetensors.torch import load_file

    from radixserve.model.loader import load_tokenizer, resolve_model
    from radixserve.front_door.requests import eos_token_ids

    model_dir = family_dir(tmp_path_factory, name)
    # An end-of-turn id besides EOS, as instruct files have it: both stop generation.
    path = write_gguf(model_dir, tmp_path_factory.mktemp("gguf") / f"{name}.gguf",
                      eot_token_id=0 if name == "qwen3" else None)
    converted = resolve_model(str(path))
    stops = eos_token_ids(load_tokenizer(converted), converted)
    assert stops == ([0, 2] if name == "qwen3" else [2]), stops
    original, back = (load_file(d / "model.safetensors") for d in (model_dir, converted))
    assert original.keys() == back.keys()
    assert all(torch.equal(original[k], back[k]) for k in original), name
    assert ModelConfig.from_dir(converted).layer_windows == \
        ModelConfig.from_dir(model_dir).layer_windows
    for field in ("head_dim", "rope_scaling", "qkv_bias", "qk_norm", "architecture"):
        assert getattr(ModelConfig.from_dir(converted), field) == getattr(
            ModelConfig.from_dir(model_dir), field), field
    hf = reference(model_dir)
    for options in (dict(page_size=1, chunked_prefill_size=16),
                    dict(page_size=16, chunked_prefill_size=512, enable_prefix_cache=False)):
        with checked_engine(path, max_total_tokens=1024, debug_invariants=True,
                            **options) as engine:
            for ids in PROMPTS[1:3]:
                res = engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
                assert_matches_reference(res["output_ids"], hf.greedy(ids, NEW), f"{name} gguf")
                full = hf.logprobs(ids + res["output_ids"])
                got = [lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]]
                want = [float(full[len(ids) + j - 1, t]) for j, t in enumerate(res["output_ids"])]
                torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4,
                                           rtol=0)


def test_gguf_llama3_rope_freqs_are_read_back(tmp_path_factory, gguf_cache):
    """transformers' GGUF reader drops RoPE scaling; the converter reads Llama 3's back
    from its `rope_freqs` tensor (yarn, from `rope.scaling.*`, is in the Qwen2 file of
    the family test) and the model runs as the original."""
    from radixserve.model.loader import resolve_model

    family = "llama"
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    model_dir = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models",
                               **{**SHAPE, "family": family, "rope_scaling": rope})
    path = write_gguf(model_dir, tmp_path_factory.mktemp("gguf") / f"{family}-rope.gguf")
    converted = resolve_model(str(path))
    assert ModelConfig.from_dir(converted).rope_scaling == ModelConfig.from_dir(
        model_dir).rope_scaling
    hf = reference(model_dir)
    with checked_engine(path, max_total_tokens=1024, page_size=4) as engine:
        res = engine.generate(input_ids=PROMPTS[2], sampling_params=GREEDY)
    assert_matches_reference(res["output_ids"], hf.greedy(PROMPTS[2], NEW), f"{family} rope")


def test_gguf_of_an_unsupported_architecture_is_refused(tmp_path: Path, gguf_cache):
    import gguf
    import numpy as np

    from radixserve.model.loader import ModelResolveError, resolve_model

    writer = gguf.GGUFWriter(tmp_path / "phi.gguf", "phi3")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelResolveError, match="unsupported GGUF architecture 'phi3'; "
                                                "supported: llama, qwen2, qwen3"):
        resolve_model(str(tmp_path / "phi.gguf"))


def test_forks_copy_partial_blocks_within_the_window(tmp_path_factory):
    """n = 3 greedy samples of a 70-token prompt share its last, partial block (copied on
    first write) and decode past the window under memory pressure (eviction and
    retraction): every sample is still transformers' tokens."""
    model_dir = family_dir(tmp_path_factory, "mistral_window")
    hf = reference(model_dir)
    with checked_engine(model_dir, max_total_tokens=160, page_size=16, chunked_prefill_size=32,
                        debug_invariants=True) as engine:
        samples = engine.generate(input_ids=[PROMPTS[2], PROMPTS[3]], sampling_params={
            **GREEDY, "n": 3, "max_new_tokens": 30})
        stats = engine.stats()
        assert stats["copied_blocks"] >= 2, stats
        assert stats["retractions"] > 0 or stats["evicted_tokens"] > 0, stats
        for i, sample in enumerate(samples):
            ids = PROMPTS[2] if i < 3 else PROMPTS[3]
            assert_matches_reference(sample["output_ids"], hf.greedy(ids, 30), f"fork {i}")
