"""Penalties over the persistent batch: the worker keeps each sequence's prompt and outputs
and each step sends only the new outputs (`PenaltyTokens`, scheduler/worker_rows.py), yet
greedy output with Hugging Face's repetition penalty equals transformers' own, with
prefills chunked and sequences joining and leaving the batch."""

from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import ENGINE_TEST_DEFAULTS, checked_engine
from tests.factories import tiny_model_dir

MAX_NEW = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("penalties"), num_layers=2, hidden_size=64)


def transformers_greedy(model_dir, ids: list[int], penalty: float) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 local_files_only=True).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW,
                             min_new_tokens=MAX_NEW, do_sample=False,
                             repetition_penalty=penalty)
    return out[0, len(ids):].tolist()


def test_repetition_penalty_equals_transformers(tiny):
    rng = random.Random(4)
    motif = [rng.randrange(100, 3000) for _ in range(5)]
    prompts = [motif * (3 + i) + [rng.randrange(100, 3000) for _ in range(i)] for i in range(4)]
    params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True,
              "repetition_penalty": 1.8}
    with checked_engine(tiny, **ENGINE_TEST_DEFAULTS, chunked_prefill_size=16) as engine:
        got = [r["output_ids"] for r in engine.generate(input_ids=prompts,
                                                        sampling_params=params)]
        plain = engine.generate(input_ids=prompts[0], sampling_params={
            **params, "repetition_penalty": 1.0})["output_ids"]
    for ids, out in zip(prompts, got):
        assert out == transformers_greedy(tiny, ids, 1.8)
    assert got[0] != plain  # the penalty bites
