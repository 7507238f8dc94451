"""Reading a PEFT adapter (lora/adapter.py): what a file may hold and how each refusal
reads, and PEFT's scaling rules (rsLoRA, rank_pattern, alpha_pattern) held to PEFT's own
output."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from radixserve.lora.adapter import WEIGHTS_FILE, load_adapter
from radixserve.model.config import ModelConfig
from tests.conftest import ENGINE_TEST_DEFAULTS, checked_engine
from tests.factories import tiny_model_dir
from tests.lora.adapters import peft_adapter, peft_greedy
from tests.lora.test_engine_lora import prompts


@pytest.fixture(scope="module")
def good(tiny, tmp_path_factory):
    return peft_adapter(tiny, tmp_path_factory.mktemp("good"), rank=8)


def edited(good: Path, tmp_path: Path, config: dict | None = None,
           tensors: dict | None = None) -> Path:
    """A copy of `good` with its config updated by `config` and its weights replaced by
    `tensors` (None: kept)."""
    out = tmp_path / "edited"
    shutil.copytree(good, out)
    if config:
        settings = json.loads((out / "adapter_config.json").read_text())
        (out / "adapter_config.json").write_text(json.dumps({**settings, **config}))
    if tensors is not None:
        save_file(tensors, str(out / WEIGHTS_FILE))
    return out


def weights(good: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(good / WEIGHTS_FILE))


def test_a_good_adapter(tiny, good):
    adapter = load_adapter("a", good, ModelConfig.from_dir(tiny), max_rank=64)
    assert adapter.rank == 8 and adapter.targets == ["q_proj", "v_proj"]
    assert len(adapter.fingerprint) == 32
    again = load_adapter("b", good, ModelConfig.from_dir(tiny), max_rank=64)
    assert again.fingerprint == adapter.fingerprint  # the weights, not the name


def refusal(tiny, path, max_rank=64, targets=None) -> str:
    config = ModelConfig.from_dir(tiny)
    with pytest.raises(ValueError) as e:
        if targets is None:
            load_adapter("x", path, config, max_rank)
        else:
            load_adapter("x", path, config, max_rank, targets)
    return str(e.value)


def test_refusals(tiny, good, tmp_path_factory, tmp_path):
    assert "no readable PEFT adapter config" in refusal(tiny, tmp_path / "missing")
    assert "rank 8 is over max_lora_rank (4)" in refusal(tiny, good, max_rank=4)
    assert "which this server was not started for" in refusal(tiny, good,
                                                              targets=("k_proj",))
    other = tiny_model_dir(tmp_path_factory.mktemp("other"), num_layers=2, hidden_size=96)
    wrong = peft_adapter(other, tmp_path_factory.mktemp("wrong"))
    assert "another base model's adapter" in refusal(tiny, wrong)
    w = weights(good)
    cases = {
        "DoRA": dict(config={"use_dora": True}),
        "bias 'all'": dict(config={"bias": "all"}),
        "modules_to_save": dict(config={"modules_to_save": ["lm_head"]}),
        "not a LoRA adapter": dict(config={"peft_type": "IA3"}),
        "lora_B is missing": dict(tensors={k: v for k, v in w.items() if "lora_B" not in k}),
        "not one of the model's projections": dict(tensors={
            "base_model.model.model.layers.0.self_attn.c_attn.lora_A.weight": torch.zeros(8, 64)}),
        "is not a LoRA A or B": dict(tensors={**w, "base_model.model.lm_head.weight":
                                              torch.zeros(4, 4)}),
        "layer 7 past the model's 2": dict(tensors={
            k.replace("layers.0.", "layers.7."): v for k, v in w.items()}),
        "not finite floats": dict(tensors={k: v * float("nan") for k, v in w.items()}),
    }
    for i, (message, edit) in enumerate(cases.items()):
        path = edited(good, tmp_path / str(i), **edit)
        assert message in refusal(tiny, path), message
    corrupt = edited(good, tmp_path / "corrupt")
    (corrupt / WEIGHTS_FILE).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    assert "not a readable safetensors file" in refusal(tiny, corrupt)
    pickled = edited(good, tmp_path / "pickled")
    (pickled / WEIGHTS_FILE).rename(pickled / "adapter_model.bin")
    assert "pickle: never loaded" in refusal(tiny, pickled)


def test_scaling_rules_equal_peft(tiny, tmp_path_factory):
    """rsLoRA, and a rank and an alpha per module by pattern, as PEFT applies them."""
    root = tmp_path_factory.mktemp("patterns")
    adapter = peft_adapter(tiny, root, rank=8, alpha=16, targets=("q_proj", "v_proj", "up_proj"),
                           rslora=True, scale=30.0, rank_pattern={"v_proj": 4},
                           alpha_pattern={"up_proj": 3})
    ids = prompts(2, shared=16, seed=3)
    with checked_engine(tiny, **ENGINE_TEST_DEFAULTS, lora_paths=[f"p={adapter}"]) as engine:
        got = engine.generate(input_ids=ids, lora_name="p", sampling_params={
            "max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    for prompt, out in zip(ids, got):
        assert out["output_ids"] == peft_greedy(tiny, adapter, prompt, 8)
