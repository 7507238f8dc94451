"""Adapters on every path the base model takes: the native kernel (fp32 on the CPU, the
default here), the masked matmuls, the Triton kernels (interpreted here, as on a GPU), one
device slot for several adapters (requests wait for it), tensor parallelism
(A and B cut like their layer), a quantized base (held to its dequantized weights + the
adapter) and the default model; each request's greedy output is transformers + PEFT's."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from radixserve.lora import slots  # noqa: E402
from tests.conftest import ENGINE_TEST_DEFAULTS, checked_engine  # noqa: E402
from tests.lora.adapters import ADAPTERS, peft_adapter, peft_greedy  # noqa: E402
from tests.lora.test_engine_lora import prompts  # noqa: E402

MAX_NEW = 10
PARAMS = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


def check_mixed(model, adapters, n: int = 8, **config) -> dict:
    """A batch mixing every adapter and the base: each output equals PEFT's; the stats."""
    names = [None, *adapters]
    ids = prompts(n, shared=24, seed=1)
    which = [names[i % len(names)] for i in range(n)]
    paths = [f"{name}={path}" for name, path in adapters.items()]
    with checked_engine(model, **{**ENGINE_TEST_DEFAULTS, **config}, lora_paths=paths) as engine:
        got = engine.generate(input_ids=ids, sampling_params=PARAMS, lora_name=which)
        stats = engine.stats()
    for prompt, name, out in zip(ids, which, got):
        want = peft_greedy(model, None if name is None else adapters[name], prompt, MAX_NEW)
        assert out["output_ids"] == want, name
    return stats


def test_triton_kernels(tiny, adapters, monkeypatch):
    """The GPU's kernels (`kernels/lora.py`), run by the interpreter."""
    pytest.importorskip("triton")
    from radixserve.kernels import lora
    monkeypatch.setattr(slots, "step_kernels", lambda device: lora)
    check_mixed(tiny, adapters, n=4, attention_backend="triton")


def test_masked_matmuls(tiny, adapters, monkeypatch):
    """Without the native kernel (another dtype, no compiler): two matmuls over the step's
    slots, masked per token."""
    monkeypatch.setattr(slots, "can_pack", lambda device, dtype: False)
    check_mixed(tiny, adapters)


def test_one_slot_for_three_adapters(tiny, adapters):
    """max_loras_per_batch=1: a request whose adapter has no slot waits, the others run;
    every request ends with PEFT's answer."""
    check_mixed(tiny, adapters, max_loras_per_batch=1, max_loaded_loras=3)


def test_tensor_parallel(tiny, adapters):
    check_mixed(tiny, adapters, tp_size=2, page_size=4)


@pytest.mark.parametrize("quantization", ["none", "q4"])
def test_default_model(model_dir, tmp_path_factory, quantization):
    """The default model in fp32, and as q4 (its weights the GGUF's own blocks, which the
    fp32 reference holds dequantized), with the adapter in float: three adapters and the
    base in one batch give PEFT's answers on the fp32 model."""
    root = tmp_path_factory.mktemp("default-adapters")
    adapters = {name: peft_adapter(model_dir, root, scale=4.0, **spec)
                for name, spec in ADAPTERS.items()}
    check_mixed(model_dir, adapters, n=4, quantization=quantization)
