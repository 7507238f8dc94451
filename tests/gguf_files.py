"""GGUF files written from Hugging Face directories, as llama.cpp's converter lays them out,
for testing the loader's GGUF path on tiny models.

Metadata and tensor names follow llama.cpp (`convert_hf_to_gguf.py`): a Llama or Mistral is
architecture `llama` with each head's q/k rows interleaved for its rotary layout, a Qwen2 or
Qwen3 keeps transformers' layout. Weights are written as float32 (no quantization, so the
converted model is the original exactly). The tokenizer metadata is copied from the default
model's GGUF, the tokenizer every tiny model uses.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from radixserve.model.loader import default_gguf_path

_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_BLOCK = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: each head's rotary halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def _llama3_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """llama.cpp's `rope_freqs` for a llama3 scaling (its `generate_extra_tensors`)."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / base ** (i / head_dim))
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


@functools.cache
def _tokenizer_fields() -> list[tuple[str, Any, Any, Any]]:
    """The default GGUF's `tokenizer.*` metadata, read once (49k tokens take seconds)."""
    import gguf

    out = []
    for key, field in gguf.GGUFReader(default_gguf_path()).fields.items():
        if key.startswith("tokenizer."):
            types = field.types
            out.append((key, field.contents(), types[0],
                        types[-1] if types[0] == gguf.GGUFValueType.ARRAY else None))
    return out


def write_gguf(hf_dir: Path, path: Path, name: str = "tiny",
               eot_token_id: int | None = None, quantized: dict[str, str] | None = None
               ) -> Path:
    """`quantized`: llama.cpp tensor kinds (`attn_q`, `ffn_down`...) written in a GGUF type
    (`Q4_0`, `Q4_1`, `Q8_0`...) instead of float32, as a quantized file mixes them."""
    import gguf
    from safetensors.numpy import load_file

    config: dict[str, Any] = json.loads((Path(hf_dir) / "config.json").read_text())
    arch = _ARCH[config["model_type"]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    kind = rope.get("rope_type", "default")
    if kind in ("linear", "yarn"):  # llama.cpp's keys; llama3 goes as rope_freqs below
        writer.add_rope_scaling_type(gguf.RopeScalingType(kind))
        writer.add_rope_scaling_factor(rope["factor"])
        if kind == "yarn":
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if kind == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_factors(rope, head_dim))
    if config["model_type"] == "mistral" and config.get("sliding_window") is not None:
        writer.add_sliding_window(config["sliding_window"])
    for key, value, vtype, sub_type in _tokenizer_fields():
        writer.add_key_value(key, value, vtype, sub_type)
    if eot_token_id is not None:
        writer.add_eot_token_id(eot_token_id)
    tensors = load_file(str(Path(hf_dir) / "model.safetensors"))
    for hf_name, w in sorted(tensors.items()):
        base, _, suffix = hf_name.rpartition(".")
        if base.startswith("model.layers."):
            _, _, layer, rest = base.split(".", 3)
            kind = _BLOCK[rest]
            if arch == "llama" and kind in ("attn_q", "attn_k"):
                w = _permute(w, heads if kind == "attn_q" else kv_heads)
            gguf_name = f"blk.{layer}.{kind}.{suffix}"
        else:
            gguf_name = f"{_GLOBAL[base]}.{suffix}"
        w = np.ascontiguousarray(w, dtype=np.float32)
        qtype = (quantized or {}).get(gguf_name.split(".")[-2])
        if qtype is None:
            writer.add_tensor(gguf_name, w)
        else:
            kind = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(gguf_name, gguf.quants.quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
