"""The decoder of every supported family (Llama, Mistral, Qwen2, Qwen3) for the flat,
paged batch layout.

The families share this one file: what differs between them is an option of the decoder
layer, chosen from the config (`model/config.py`): bias on q/k/v and on o, RMSNorm on each
head of q and k (Qwen3), a sliding window per layer (Mistral, windowed Qwen).

All sequences of a step are packed into one token stream `[T]`; attention reaches each
sequence's past through the paged KV cache via the attention backend, so the model itself
has no notion of batch or padding. Logits are computed only for the rows asked for.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from torch import nn

import radixserve.native as native
from radixserve.model.config import ModelConfig
from radixserve.model.linear import F32Weight, Linear, PackedWeight
from radixserve.model.quant.groups import Groups
from radixserve.model.shards import ModelShards
from radixserve.worker.attention.base import AttentionBackend
from radixserve.worker.tensor_parallel import TPGroup


class RMSNorm(nn.Module):
    """RMSNorm, optionally with the residual add before it: `norm(x, delta)` adds `delta`
    into `x` in place (the residual stream) and normalises the sum."""

    use_native = False
    """Set by `DecoderModel.pack`: run 2-D rows through the fused CPU kernel
    (`native/rms_norm.cpp`; the add and the norm in one pass, transformers' rounding up to
    the order of one sum)."""
    fused: Callable[..., torch.Tensor] | None = None
    """Set by `DecoderModel.fuse`: the Triton kernel for 2-D rows (`kernels/fused.py`)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        if self.fused is not None and x.dim() == 2:
            return self.fused(x, delta, self.weight, self.eps)
        if self.use_native and x.dim() == 2 and x.is_contiguous() and \
                (delta is None or delta.is_contiguous()):
            return native.add_rms_norm(x, delta, self.weight, self.eps)
        if delta is not None:
            x.add_(delta)
        if x.dtype == torch.float32:  # one call, bit for bit transformers' fp32 result
            return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 and cast before the weight, as transformers does: the same
        # rounding in bf16.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":
        return _yarn(config, inv_freq)[0]
    raise ValueError(f"unsupported rope_scaling type {kind!r}")  # config.py refuses it first


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor on cos and sin (YaRN's attention temperature; 1 otherwise)."""
    scaling = config.rope_scaling
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    return _yarn(config, None)[1]


def _yarn(config: ModelConfig, inv_freq: torch.Tensor | None) -> tuple[torch.Tensor | None, float]:
    """YaRN (NTK-by-parts interpolation and an attention temperature), as transformers'
    `_compute_yarn_parameters` computes it."""
    scaling, dim, base = config.rope_scaling, config.head_dim, config.rope_theta
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all \
            else mscale(factor)
    if inv_freq is None:
        return None, attention_factor
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    interpolation = inv_freq / factor
    return interpolation * (1 - extrapolation) + inv_freq * extrapolation, attention_factor


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, looked up once per step for all layers."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inv_freq(config))
        emb = torch.cat([freqs, freqs], dim=-1)
        factor = rope_attention_factor(config)
        cos, sin = emb.cos(), emb.sin()
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`[T, 1, head_dim]` cos and sin of each token's position."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 in_place: bool = False) -> torch.Tensor:
    """Rotate `x` (`[T, heads, head_dim]`, any strides with head_dim contiguous), as
    transformers does. `in_place` (fp32 on a CPU with the native kernels): into `x`
    itself, bit for bit the same values."""
    if in_place:
        native.rotary_(x, cos, sin)
        return x
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Attention(nn.Module):
    use_native = False
    """Set by `DecoderModel.pack`: rotate q and k in place (`native/rotary.cpp`)."""
    rope_in_store = False
    """Set by `DecoderModel.fuse`: the backend rotates q and k as it stores K (`rope=`)."""

    def __init__(self, config: ModelConfig, layer: int, shards: ModelShards, tp: TPGroup) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = shards.num_heads, shards.num_kv_heads
        self.head_dim = config.head_dim
        self.tp = tp
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.window = config.window_of(layer)
        q_full = config.num_heads * self.head_dim
        kv_full = config.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, (q_full, kv_full, kv_full),
                               bias=config.qkv_bias,
                               shard=(shards.column(), shards.kv_column(), shards.kv_column()))
        self.o_proj = Linear(q_full, config.hidden_size, bias=config.o_bias, shard=shards.row())
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                backend: AttentionBackend, kv_cache: tuple[torch.Tensor, torch.Tensor]):
        qkv = self.qkv_proj(x)
        qk = qkv[:, :self.q_size + self.kv_size].view(
            -1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm:  # per head, over head_dim, before the rotation (Qwen3)
            qk = torch.cat([self.q_norm(qk[:, :self.num_heads]),
                            self.k_norm(qk[:, self.num_heads:])], dim=1)
        if not self.rope_in_store:  # q and k side by side in the fused output: one rotation
            qk = apply_rotary(qk, *rope, in_place=self.use_native)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(-1, self.num_kv_heads, self.head_dim)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], self.scale, window=self.window,
                              rope=rope if self.rope_in_store else None)
        return self.tp.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, shards: ModelShards, tp: TPGroup) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.tp = tp
        self.gate_up_proj = Linear(config.hidden_size, (inter, inter), bias=config.mlp_bias,
                                   shard=shards.column())
        self.down_proj = Linear(inter, config.hidden_size, bias=config.mlp_bias,
                                shard=shards.row())
        self.silu_mul: Callable[[torch.Tensor], torch.Tensor] = silu_mul  # fuse(): Triton's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.silu_mul(self.gate_up_proj(x))))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) x up of the fused gate/up projection's output (gate first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, shards: ModelShards, tp: TPGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer, shards, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, shards, tp)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, rope, backend,
                kv_cache) -> torch.Tensor:
        """Adds the previous layer's output `delta` into the residual stream `x` (in place,
        fused with this layer's first norm) and returns this layer's output, which the next
        layer's norm, or the final one, adds in turn."""
        attended = self.self_attn(self.input_layernorm(x, delta), rope, backend, kv_cache)
        return self.mlp(self.post_attention_layernorm(x, attended))


class DecoderModel(nn.Module):
    """`forward(input_ids[T], positions[T], logit_rows[R]) -> logits[R, vocab]`.

    Under tensor parallelism (`tp` of more than one rank) this is one rank's shard
    (`model/shards.py`): its heads, its share of the MLP and of the vocabulary; the
    layers' partial sums are all-reduced, and the logits gathered on rank 0 (None on the
    other ranks)."""

    def __init__(self, config: ModelConfig, max_positions: int, tp: TPGroup = TPGroup()) -> None:
        super().__init__()
        self.config, self.tp = config, tp
        self.shards = shards = ModelShards.of(config, tp.rank, tp.world)
        self.embed_tokens = nn.Embedding(shards.vocab_rows, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, shards, tp)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, max_positions)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, shards.vocab_rows, bias=False)
        self.packed_head: PackedWeight | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                logit_rows: torch.Tensor, backend: AttentionBackend,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        x = self._embed(input_ids)
        rope = self.rotary(positions, x.dtype)
        delta = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            delta = layer(x, delta, rope, backend, kv_cache)
        x = self.norm(x[logit_rows], None if delta is None else delta[logit_rows])
        if self.packed_head is not None:
            logits = self.packed_head.matmul(x, None)
        else:
            logits = nn.functional.linear(x, self.head_weight)
        if self.tp.world == 1:
            return logits
        # The last rank's range may hold fewer rows than the others (a GGUF head is cut
        # exactly): pad to a common width for the gather, then keep the vocabulary's.
        logits = nn.functional.pad(logits, (0, self.shards.vocab_rows - logits.shape[1]))
        logits = self.tp.gather_columns(logits)
        return None if logits is None else logits[:, :self.config.vocab_size]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world == 1:
            return self.embed_tokens(input_ids)
        # This rank's rows of the vocabulary; the others' tokens add zeros here.
        local = input_ids - self.shards.vocab_start
        mine = (local >= 0) & (local < self.shards.vocab_rows)
        x = self.embed_tokens(local.clamp(0, self.shards.vocab_rows - 1))
        return self.tp.all_reduce(x * mine[:, None].to(x.dtype))

    @property
    def vocab_range(self) -> slice:
        """This rank's rows of the vocabulary (the whole of it with one rank)."""
        start = self.shards.vocab_start
        return slice(start, min(self.config.vocab_size, start + self.shards.vocab_rows))

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def linears(self) -> dict[str, Linear]:
        """Every projection, by module name (`layers.0.self_attn.qkv_proj`)."""
        return {name: m for name, m in self.named_modules() if isinstance(m, Linear)}

    def pack(self) -> None:
        """Run every dense projection and the LM head through this project's fp32 kernel
        (`linear.F32Weight`); call once the weights are loaded and cast, on a CPU in fp32
        (`can_pack`)."""
        for module in self.linears().values():
            if module.packed is None:
                module.pack()
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention)):
                module.use_native = True
        if self.packed_head is None:
            self.set_head(F32Weight(self.head_weight))  # a tied head shares the embedding

    def fuse(self) -> None:
        """The residual add with RMSNorm, RoPE with the KV store (by a backend that
        `fuses_rope`) and SiLU x up through Triton (`kernels/fused.py`)."""
        from radixserve.kernels import fused  # imports triton: only on this path
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.fused = fused.add_rms_norm
            elif isinstance(module, Attention):
                module.rope_in_store = True
            elif isinstance(module, MLP):
                module.silu_mul = fused.silu_mul

    def set_head(self, packed: PackedWeight) -> None:
        """Run the LM head from `packed` (the dense weight stays for a tied embedding)."""
        self.packed_head = packed
        if not self.config.tie_word_embeddings:
            self.lm_head.weight.data = self.lm_head.weight.data.new_empty(0)

    def quantize(self, method: str, file_groups: dict[str, Groups] | None = None) -> int:
        """Hold every projection in `method`'s format (`int8`, `q4`); the embedding and the
        LM head stay as loaded (`set_head` gives the head another format). For `q4`, a projection part whose Hugging Face name
        (`model.layers.0.self_attn.q_proj.weight`) is in `file_groups` takes those 4-bit
        groups as they are; the others are quantized from their float weights (every part,
        for `int8`), and their count is returned."""
        from_floats = 0
        for name, module in self.linears().items():
            owner, _, fused = name.rpartition(".")
            parts = [(file_groups or {}).get(f"model.{owner}.{proj}.weight")
                     for proj in FUSED.get(fused, (fused,))]
            from_floats += module.quantize(method, parts)
        return from_floats

    @torch.no_grad()
    def load_weights(self, model_dir: str | Path) -> None:
        """Copy Hugging Face weights in (any supported family: the names are Llama's, plus
        q/k biases and q_norm/k_norm where the family has them), each projection through
        its `Linear.load`, fusing q/k/v and gate/up projections."""
        params = dict(self.named_parameters())
        linears = self.linears()
        part_of = {proj: (fused, i) for fused, projs in FUSED.items()
                   for i, proj in enumerate(projs)}
        loaded: set[str] = set()
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if "rotary_emb" in name:
                        continue
                    target = name.removeprefix("model.")
                    if target == "lm_head.weight" and self.config.tie_word_embeddings:
                        continue
                    tensor = f.get_tensor(name)
                    module, _, kind = target.rpartition(".")
                    owner, _, proj = module.rpartition(".")
                    fused, part = part_of.get(proj, (proj, 0))
                    linear = linears.get(f"{owner}.{fused}")
                    if linear is not None and kind in ("weight", "bias"):
                        linear.load(kind, part, tensor)
                        target = f"{owner}.{fused}.{kind}"
                    elif target in ("embed_tokens.weight", "lm_head.weight"):
                        rows = tensor[self.vocab_range]  # past the vocabulary: zeros
                        params[target][:len(rows)].copy_(rows)
                        params[target][len(rows):].zero_()
                    elif target in params:
                        params[target].copy_(tensor)
                    else:
                        raise KeyError(f"unexpected weight {name!r} in {file.name}")
                    loaded.add(target)
        missing = set(params) - loaded
        if missing:
            raise KeyError(f"weights missing from {model_dir}: {sorted(missing)[:5]}")


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""Each fused projection's parts, in the order their rows are stacked."""
