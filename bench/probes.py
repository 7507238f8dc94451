"""Single-request probes of the engine against the machine's limits, and the model's shape.

- prefill: prompts of `prefill_tokens` random tokens, `max_new_tokens=1`, nothing cached
  (distinct prompts, cache flushed before each): achieved GFLOP/s = the prompt's FLOPs /
  TTFT, against the measured fp32 matmul rate;
- decode at batch 1: one request's time per output token after the first, against the
  floor set by reading every weight once per step at the measured read bandwidth;
- TTFT of a request whose system prompt is cached, against the same shape cold.

FLOPs of a prompt of L tokens: 2 x non-embedding params per token (the matmuls), plus
attention (QK^T and PV: 4 x heads x head_dim x context per token per layer, causal), plus
one row of the LM head (logits only for the last token). Bytes of a decode step: the fp32
weights that are read (non-embedding params and the LM head; the embedding lookup reads
one row) plus the KV cache read by attention.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

from radixserve.model.config import ModelConfig


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: int
    non_embedding_params: int

    @classmethod
    def from_config(cls, c: ModelConfig) -> ModelShape:
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        layer = (c.hidden_size * (q + 2 * kv) + q * c.hidden_size  # qkv, o
                 + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size)  # mlp, norms
        if c.qkv_bias:
            layer += q + 2 * kv
        if c.o_bias:
            layer += c.hidden_size
        if c.qk_norm:
            layer += 2 * c.head_dim
        if c.mlp_bias:
            layer += 2 * c.intermediate_size + c.hidden_size
        non_embedding = c.num_layers * layer + c.hidden_size
        embed = c.vocab_size * c.hidden_size
        params = non_embedding + embed * (1 if c.tie_word_embeddings else 2)
        return cls(c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                   c.vocab_size, params, non_embedding)

    def prefill_flops(self, prompt_len: int) -> float:
        """FLOPs of prefilling one prompt of `prompt_len` tokens from scratch."""
        attention = 2 * self.heads * self.head_dim * prompt_len * (prompt_len + 1) * self.layers
        return 2 * self.non_embedding_params * prompt_len + attention + 2 * self.vocab * self.hidden

    def decode_bytes(self, context: int, dtype_bytes: int = 4) -> float:
        """Bytes one batch-1 decode step must read at `context` cached tokens."""
        weights = self.non_embedding_params + self.vocab * self.hidden
        kv = 2 * self.layers * self.kv_heads * self.head_dim * context
        return (weights + kv) * dtype_bytes

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def _random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def probe_prefill(engine: Any, shape: ModelShape, matmul_gflops: float, prompt_len: int,
                  repeats: int = 3, seed: int = 1) -> dict[str, Any]:
    rng = random.Random(seed)
    ttfts = []
    for _ in range(repeats):
        engine.flush_cache()
        res = engine.generate(input_ids=_random_prompt(rng, prompt_len),
                              sampling_params={"max_new_tokens": 1, "temperature": 0.0})
        ttfts.append(res["meta_info"]["ttft"])
    best = min(ttfts)
    gflops = shape.prefill_flops(prompt_len) / best / 1e9
    return {"prompt_tokens": prompt_len, "ttft_s": ttfts, "tokens_per_s": prompt_len / best,
            "gflops": gflops, "fraction_of_matmul": gflops / matmul_gflops}


def probe_decode(engine: Any, shape: ModelShape, read_gbs: float, steps: int = 32,
                 prompt_len: int = 32, repeats: int = 2, seed: int = 2) -> dict[str, Any]:
    rng = random.Random(seed)
    step_times = []
    for _ in range(repeats):
        engine.flush_cache()
        res = engine.generate(input_ids=_random_prompt(rng, prompt_len), sampling_params={
            "max_new_tokens": steps + 1, "temperature": 0.0, "ignore_eos": True})
        meta = res["meta_info"]
        step_times.append((meta["e2e_latency"] - meta["ttft"]) / steps)
    best = min(step_times)
    nbytes = shape.decode_bytes(prompt_len + steps // 2)
    floor = nbytes / (read_gbs * 1e9)
    return {"step_s": step_times, "bytes_per_step": nbytes, "floor_s": floor,
            "achieved_gbs": nbytes / best / 1e9, "fraction_of_bandwidth": floor / best}


def probe_ttft_cached(engine: Any, system: list[int], questions: list[list[int]],
                      repeats: int = 2) -> dict[str, Any]:
    """Cold: flush, then `system + questions[0]`. Cached: then `system + questions[1]`."""
    colds, warms, cached = [], [], 0
    params = {"max_new_tokens": 1, "temperature": 0.0}
    for _ in range(repeats):
        engine.flush_cache()
        colds.append(engine.generate(input_ids=system + questions[0],
                                     sampling_params=params)["meta_info"]["ttft"])
        meta = engine.generate(input_ids=system + questions[1], sampling_params=params)["meta_info"]
        warms.append(meta["ttft"])
        cached = meta["cached_tokens"]
    return {"system_tokens": len(system), "cold_s": min(colds), "cached_s": min(warms),
            "cached_tokens": cached, "ratio": min(warms) / min(colds)}
