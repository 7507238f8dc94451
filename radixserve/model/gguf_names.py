"""llama.cpp's tensor names and row order mapped to Hugging Face's, for the GGUF converter
(`loader.py`) and the 4-bit block reader (`quant/gguf_q4.py`)."""

from __future__ import annotations

from typing import Any

_PERMUTED_QK = frozenset({"llama"})
"""Architectures whose q/k rows llama.cpp interleaves per head (its Llama rotary layout);
Qwen2 and Qwen3 keep transformers' layout (llama.cpp runs them with NeoX rotary)."""

# llama.cpp tensor names -> Hugging Face parameter names (per block and global); the same
# names for every mapped family (q/k/v biases keep their `.bias` suffix).
_LLAMA_BLOCK = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_LLAMA_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}


def gguf_hf_name(name: str, arch: str, heads: int, kv_heads: int) -> tuple[str, int | None]:
    """The Hugging Face name of a GGUF tensor, and the head count whose rotary row order
    `unpermute_rows` must undo (q/k of a `_PERMUTED_QK` architecture; else None)."""
    base, _, suffix = name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LLAMA_BLOCK:
        n = {"attn_q": heads, "attn_k": kv_heads}.get(parts[2])
        return (f"model.layers.{parts[1]}.{_LLAMA_BLOCK[parts[2]]}.{suffix}",
                n if arch in _PERMUTED_QK else None)
    if base in _LLAMA_GLOBAL:
        return f"{_LLAMA_GLOBAL[base]}.{suffix}", None
    raise ValueError(f"unexpected tensor {name} in a {arch} GGUF")


def unpermute_rows(w: Any, n: int) -> Any:
    """Undo llama.cpp's per-head interleaving of rotary halves (GPT-J style) in the rows of
    `w` (HF keeps them split, NeoX style). Whole rows move, so an array of row indices
    gives the permutation itself."""
    shape = w.shape
    return w.reshape(n, shape[0] // n // 2, 2, *shape[1:]).swapaxes(2, 1).reshape(shape)
