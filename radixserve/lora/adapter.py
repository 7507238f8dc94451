"""A LoRA adapter in PEFT's format, read and checked against the base model.

A PEFT LoRA directory holds `adapter_config.json` and `adapter_model.safetensors`; each
adapted projection `model.layers.{i}.{self_attn|mlp}.{proj}` has `lora_A.weight` `[r, in]`
and `lora_B.weight` `[out, r]`, and adds `x A^T B^T * scaling` to the projection's output,
`scaling = lora_alpha / r` (`lora_alpha / sqrt(r)` with `use_rslora`), r and alpha per
module from `rank_pattern` / `alpha_pattern` where they match (PEFT's own rules).

Everything that would change the answer and is not applied here (DoRA, trained biases,
`modules_to_save`, embedding or head adapters) is refused by name, as is a file that does
not fit the base (another model's shapes, a layer it lacks, a rank over the limit, a target
the server was not started for). Weights are read with safetensors only: a pickled
`adapter_model.bin` is never loaded.

An adapter's `fingerprint` names its weights and scaling: KV computed under it is cached
under it (`cache_namespace`), so a different file reloaded under the same name never reuses
the old adapter's KV.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from radixserve.config_checks import LORA_TARGETS as TARGETS
from radixserve.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])\.weight")
_REFUSED = {"use_dora": "DoRA", "lora_bias": "a trained LoRA bias"}


def module_dims(config: ModelConfig, proj: str) -> tuple[int, int]:
    """A projection's full `(in, out)` features."""
    h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    q, inter = config.num_heads * config.head_dim, config.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}[proj]


@dataclass
class LoraAdapter:
    name: str
    path: str
    fingerprint: str
    rank: int
    """The largest rank of any of its modules."""
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    """`(layer, proj)` -> `(A [r, in], B [out, r] times the module's scaling)`, fp32."""

    @property
    def targets(self) -> list[str]:
        return sorted({proj for _, proj in self.modules})

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "fingerprint": self.fingerprint,
                "rank": self.rank, "target_modules": self.targets}


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int,
                 targets: tuple[str, ...] = TARGETS) -> LoraAdapter:
    """Read and check the adapter at `path` (a PEFT LoRA directory) for the base `config`;
    ValueError naming the problem (a missing or corrupt file, a setting not applied here,
    shapes of another base, a rank over `max_rank`, a module outside `targets`)."""
    where = Path(path)
    settings = _read_config(where)
    weights_file = where / WEIGHTS_FILE
    if not weights_file.is_file():
        extra = " (adapter_model.bin is pickle: never loaded)" if (
            where / "adapter_model.bin").exists() else ""
        raise ValueError(f"LoRA adapter {name!r}: no {WEIGHTS_FILE} in {where}{extra}")
    raw = weights_file.read_bytes()
    try:
        tensors = load_safetensors(raw)
    except Exception as e:  # safetensors raises its own error types for a corrupt header
        raise ValueError(f"LoRA adapter {name!r}: {weights_file} is not a readable "
                         f"safetensors file ({e})") from None
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise ValueError(f"LoRA adapter {name!r}: weight {key!r} is not a LoRA A or B of a "
                             f"decoder projection ({', '.join(TARGETS)})")
        layer, proj = int(m.group(1)), m.group(3)
        if proj not in TARGETS:
            raise ValueError(f"LoRA adapter {name!r}: target module {proj!r} is not one of the "
                             f"model's projections ({', '.join(TARGETS)})")
        if proj not in targets:
            raise ValueError(f"LoRA adapter {name!r} adapts {proj!r}, which this server was not "
                             f"started for (lora_target_modules: {', '.join(targets)})")
        if layer >= config.num_layers:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} past the model's "
                             f"{config.num_layers}")
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise ValueError(f"LoRA adapter {name!r}: weight {key!r} is not finite floats")
        pairs.setdefault((layer, proj), {})[m.group(4)] = t.float()
    if not pairs:
        raise ValueError(f"LoRA adapter {name!r}: {weights_file} holds no LoRA weights")
    modules = {}
    for (layer, proj), ab in sorted(pairs.items()):
        modules[(layer, proj)] = _module(name, settings, config, layer, proj, ab, max_rank)
    digest = hashlib.blake2b(raw, digest_size=16, person=b"radixserve-lora")
    digest.update(json.dumps(_scaling_fields(settings), sort_keys=True).encode())
    return LoraAdapter(name, str(path), digest.hexdigest(),
                       max(a.shape[0] for a, _ in modules.values()), modules)


def _read_config(where: Path) -> dict[str, Any]:
    file = where / CONFIG_FILE
    try:
        if file.stat().st_size > MAX_CONFIG_BYTES:
            raise ValueError(f"{file} is over {MAX_CONFIG_BYTES} bytes")
        settings = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"no readable PEFT adapter config at {file}: {e}") from None
    if not isinstance(settings, dict) or settings.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{file}: not a LoRA adapter (peft_type "
                         f"{settings.get('peft_type') if isinstance(settings, dict) else None!r})")
    for key, what in _REFUSED.items():
        if settings.get(key):
            raise ValueError(f"{file}: {what} ({key}) is not supported")
    if settings.get("bias", "none") != "none":
        raise ValueError(f"{file}: bias {settings['bias']!r} trains biases this server does not "
                         "apply (only bias 'none')")
    if settings.get("modules_to_save"):
        raise ValueError(f"{file}: modules_to_save {settings['modules_to_save']!r} replaces whole "
                         "modules, which is not supported")
    if settings.get("fan_in_fan_out"):
        raise ValueError(f"{file}: fan_in_fan_out (GPT-2 style Conv1D weights) is not supported")
    for key in ("r", "lora_alpha"):
        if not isinstance(settings.get(key, 8), (int, float)) or settings.get(key, 8) <= 0:
            raise ValueError(f"{file}: {key} must be a positive number")
    return settings


def _scaling_fields(settings: dict[str, Any]) -> dict[str, Any]:
    return {k: settings.get(k) for k in ("r", "lora_alpha", "use_rslora", "rank_pattern",
                                          "alpha_pattern")}


def _pattern(patterns: Any, module: str, default: float) -> float:
    """PEFT's `get_pattern_key`: a pattern names a module when the module's name ends with
    it, at a dot."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _module(name: str, settings: dict[str, Any], config: ModelConfig, layer: int, proj: str,
            ab: dict[str, torch.Tensor], max_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    where = f"LoRA adapter {name!r}, layer {layer} {proj}"
    if set(ab) != {"A", "B"}:
        raise ValueError(f"{where}: lora_{'B' if 'A' in ab else 'A'} is missing")
    a, b = ab["A"], ab["B"]
    n_in, n_out = module_dims(config, proj)
    r = a.shape[0] if a.dim() == 2 else -1
    if a.shape != (r, n_in) or b.shape != (n_out, r):
        raise ValueError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not "
                         f"fit this model's {proj} ({n_in} -> {n_out}): another base model's "
                         "adapter?")
    if r > max_rank:
        raise ValueError(f"{where}: rank {r} is over max_lora_rank ({max_rank})")
    module = f"model.layers.{layer}.{'self_attn' if proj[0] in 'qkvo' else 'mlp'}.{proj}"
    alpha = _pattern(settings.get("alpha_pattern"), module, settings.get("lora_alpha", 8))
    scaling = alpha / (math.sqrt(r) if settings.get("use_rslora") else r)
    return a.contiguous(), (b * scaling).contiguous()
