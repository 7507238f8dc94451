"""The shape of a supported decoder model, read from a Hugging Face `config.json`.

`ARCHITECTURES` is the one place that maps an architecture name to what the project's
decoder (`model/llama.py`) must do for it: the families differ only in options of the one
decoder layer (bias on q/k/v and o, RMSNorm on q and k per head, a sliding window on some
layers), chosen here from the config. Anything in a config that would change the math and
is not implemented is an error naming it, raised before any weight is read.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROPE_KINDS = ("default", "linear", "llama3", "yarn")
"""RoPE scaling kinds the decoder implements (`model/rotary.py:rope_inv_freq`)."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] | None = None
    qkv_bias: bool = False
    """Bias on the q, k and v projections (Qwen2; Llama and Qwen3 with attention_bias)."""
    o_bias: bool = False
    """Bias on the output projection (Llama and Qwen3 with attention_bias; never Qwen2)."""
    mlp_bias: bool = False
    qk_norm: bool = False
    """RMSNorm over head_dim on each head of q and of k, before RoPE (Qwen3)."""
    layer_windows: tuple[int | None, ...] = ()
    """Per layer: the sliding window (a query at position i reads keys i-w+1 .. i), or
    None for full attention. Empty means full attention everywhere."""
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    architecture: str = "LlamaForCausalLM"

    @property
    def attention_bias(self) -> bool:
        return self.qkv_bias or self.o_bias

    @property
    def sliding_window(self) -> int | None:
        """The widest window of any layer, or None when every layer attends fully."""
        windows = [w for w in self.layer_windows if w is not None]
        return max(windows) if windows else None

    def window_of(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def for_context(self, context_length: int) -> ModelConfig:
        """This config with every window that cannot bind within `context_length` tokens
        dropped: a query at position i < w reads all of 0..i either way."""
        windows = tuple(None if w is None or w >= context_length else w
                        for w in self.layer_windows)
        if all(w is None for w in windows):
            windows = ()
        return replace(self, layer_windows=windows)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        raw = json.loads((Path(path) / "config.json").read_text())
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        arch = architecture_of(raw)
        family = ARCHITECTURES[arch]
        raw = {**family.defaults, **raw}  # what the family's config class fills in
        _check_common(raw, arch)
        rope_theta, scaling = _rope(raw, arch)
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        num_layers = raw["num_hidden_layers"]
        options = family.options(raw, num_layers)
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            rope_scaling=scaling,
            eos_token_ids=eos_ids,
            architecture=arch,
            **options,
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class Family:
    """What one Hugging Face architecture needs of the decoder."""

    model_type: str
    options: Callable[[dict[str, Any], int], dict[str, Any]]
    """`(raw config, num_layers) -> ModelConfig fields` (bias, qk-norm, windows); raises
    ValueError on a field it does not implement."""
    gguf_arch: str
    """llama.cpp's `general.architecture` for this family."""
    defaults: dict[str, Any] = field(default_factory=dict)
    """Defaults of transformers' config class that differ from `ModelConfig.from_dict`'s,
    for a config.json that leaves them out."""


def _llama(raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
    _refuse_window(raw, "LlamaForCausalLM")
    bias = bool(raw.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=bool(raw.get("mlp_bias", False)))


def _mistral(raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
    # transformers' MistralModel ignores attention_bias and mlp_bias: so do we, as it does.
    if raw.get("layer_types") is not None:
        raise ValueError("MistralForCausalLM with layer_types (alternating attention, "
                         "Ministral) is not supported: transformers' Mistral applies "
                         "sliding_window to every layer and ignores layer_types")
    # MistralConfig's default window is 4096: a config.json without the key gets it.
    window = raw.get("sliding_window", 4096)
    return dict(layer_windows=(_window(window),) * num_layers if window is not None else ())


def _qwen(qk_norm: bool, arch: str) -> Callable[[dict[str, Any], int], dict[str, Any]]:
    def options(raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
        out: dict[str, Any]
        if qk_norm:  # Qwen3: q, k, v and o all follow attention_bias
            bias = bool(raw.get("attention_bias", False))
            out = dict(qkv_bias=bias, o_bias=bias, qk_norm=True)
        else:  # Qwen2: bias on q, k and v always, never on o (attention_bias is ignored)
            out = dict(qkv_bias=True, o_bias=False)
        out["layer_windows"] = _qwen_windows(raw, num_layers, arch)
        return out
    return options


def _qwen_windows(raw: dict[str, Any], num_layers: int, arch: str) -> tuple[int | None, ...]:
    """As Qwen2Config / Qwen3Config read them: no window unless use_sliding_window; then
    the layers layer_types marks "sliding_attention", or else those from max_window_layers
    on."""
    if not raw.get("use_sliding_window", False):
        return ()
    window = raw.get("sliding_window", 4096)
    if window is None:
        return ()
    types = raw.get("layer_types")
    if types is None:
        first = raw.get("max_window_layers", 28)
        types = ["sliding_attention" if i >= first else "full_attention"
                 for i in range(num_layers)]
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown or len(types) != num_layers:
        raise ValueError(f"{arch}: unsupported layer_types {sorted(unknown) or types} "
                         "(supported: full_attention, sliding_attention, one per layer)")
    w = _window(window)
    return tuple(w if t == "sliding_attention" else None for t in types)


def _window(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"sliding_window must be a positive integer or null, got {value!r}")
    return value


def _refuse_window(raw: dict[str, Any], arch: str) -> None:
    if raw.get("sliding_window") is not None or raw.get("use_sliding_window"):
        raise ValueError(f"{arch} with sliding_window is not supported (transformers' "
                         f"{arch} has no sliding window); sliding windows are implemented "
                         "for MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM")


ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama", _llama, "llama"),
    "MistralForCausalLM": Family("mistral", _mistral, "llama",
                                 {"max_position_embeddings": 4096 * 32}),
    "Qwen2ForCausalLM": Family("qwen2", _qwen(False, "Qwen2ForCausalLM"), "qwen2",
                               {"max_position_embeddings": 32768}),
    "Qwen3ForCausalLM": Family("qwen3", _qwen(True, "Qwen3ForCausalLM"), "qwen3",
                               {"max_position_embeddings": 32768, "head_dim": 128}),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)

_MODEL_TYPES = {f.model_type: arch for arch, f in ARCHITECTURES.items()}


def architecture_of(raw: dict[str, Any]) -> str:
    """The supported architecture a config names (`architectures`, else `model_type`), or
    a ValueError naming what it names and listing what is supported."""
    archs = raw.get("architectures")
    if not archs:
        model_type = raw.get("model_type", "llama")
        if model_type in _MODEL_TYPES:
            return _MODEL_TYPES[model_type]
        archs = [f"model_type {model_type!r}"]
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    raise ValueError(f"unsupported architecture {', '.join(archs)}; supported: "
                     f"{', '.join(SUPPORTED_ARCHITECTURES)}")


_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


def _check_common(raw: dict[str, Any], arch: str) -> None:
    """Fields any family might carry that change the math and are not implemented."""
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{arch}: unsupported hidden_act {raw['hidden_act']!r} (only silu)")
    for key in _MOE_KEYS:
        if raw.get(key):
            raise ValueError(f"{arch}: mixture-of-experts ({key}={raw[key]!r}) is not "
                             "supported; only dense models run")
    partial = raw.get("partial_rotary_factor", 1.0)
    if partial not in (None, 1, 1.0):
        raise ValueError(f"{arch}: unsupported partial_rotary_factor {partial!r} (only 1.0)")
    tp = raw.get("pretraining_tp", 1)
    if tp not in (None, 1):
        raise ValueError(f"{arch}: unsupported pretraining_tp {tp!r} (only 1)")


def _rope(raw: dict[str, Any], arch: str) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and the scaling dict (None for plain RoPE); an unimplemented kind is an
    error here, before the model is built."""
    # transformers 5 nests rope settings under rope_parameters; 4.x keeps them flat.
    rope = dict(raw.get("rope_parameters") or {})
    rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    partial = rope.pop("partial_rotary_factor", 1.0)
    if partial not in (None, 1, 1.0):
        raise ValueError(f"{arch}: unsupported partial_rotary_factor {partial!r} (only 1.0)")
    scaling = raw.get("rope_scaling") or rope or None
    if scaling is None:
        return rope_theta, None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_KINDS:
        raise ValueError(f"{arch}: unsupported rope_scaling type {kind!r} "
                         f"(supported: {', '.join(ROPE_KINDS)})")
    if kind == "yarn" and not scaling.get("original_max_position_embeddings"):
        raise ValueError(f"{arch}: yarn rope_scaling needs original_max_position_embeddings")
    return rope_theta, None if kind == "default" else {**scaling, "rope_type": kind}
