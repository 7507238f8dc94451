"""The project's Llama against transformers on tiny random configs: every architectural
option the loader accepts (GQA ratios, untied embeddings, llama3 and linear RoPE scaling)
and bfloat16."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import checked_engine
from tests.factories import tiny_model_dir
from tests.hf_reference import HFReference, assert_matches_reference

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
PROMPTS = [[5, 17, 230, 4000, 99, 12, 7, 7, 7, 300], [1] + list(range(100, 190)), [42]]


@pytest.mark.parametrize("variant", [
    dict(num_heads=4, num_kv_heads=4),
    dict(num_heads=6, num_kv_heads=2),
    dict(num_heads=8, num_kv_heads=1, tie_word_embeddings=False),
    dict(rope_scaling=LLAMA3),
    dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
], ids=["mha", "gqa3", "mqa_untied", "llama3_rope", "linear_rope"])
def test_tiny_variants_match_transformers(tmp_path_factory, variant):
    root = tmp_path_factory.getbasetemp() / "tiny-models"
    model_dir = tiny_model_dir(root, hidden_size=96 if variant.get("num_heads") == 6 else 64,
                               **variant)
    hf = HFReference(model_dir)
    with checked_engine(model_dir, max_total_tokens=1024, page_size=4, chunked_prefill_size=32,
                        debug_invariants=True) as engine:
        results = engine.generate(input_ids=PROMPTS, sampling_params={
            "max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
        for ids, res in zip(PROMPTS, results):
            assert_matches_reference(res["output_ids"], hf.greedy(ids, 12), str(variant))


def test_bfloat16_runs_close_to_fp32(tmp_path_factory):
    model_dir = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    with checked_engine(model_dir, dtype="bfloat16", max_total_tokens=256) as bf16, \
            checked_engine(model_dir, max_total_tokens=256) as fp32:
        assert bf16.worker.pool.buffer.dtype == torch.bfloat16
        a = bf16.generate(input_ids=PROMPTS[0], sampling_params=params, return_logprob=True)
        b = fp32.generate(input_ids=PROMPTS[0], sampling_params=params, return_logprob=True)
        # Tiny random weights give confident logits, so bf16 rounding keeps the first tokens.
        assert a["output_ids"][:3] == b["output_ids"][:3]
        lp_a = a["meta_info"]["output_token_logprobs"][0][0]
        lp_b = b["meta_info"]["output_token_logprobs"][0][0]
        assert abs(lp_a - lp_b) < 0.1
