"""The LoRA tests' tiny model and the three PEFT adapters of `ADAPTERS` made for it (module
fixtures: each test module builds them once; the folders are cached by their arguments)."""

from __future__ import annotations

import pytest

from tests.factories import tiny_model_dir
from tests.lora.adapters import ADAPTERS, peft_adapter


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("lora"), num_layers=2, hidden_size=64)


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: peft_adapter(tiny, root, scale=30.0, **spec) for name, spec in ADAPTERS.items()}
