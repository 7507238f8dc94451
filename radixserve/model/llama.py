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

from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from torch import nn

import radixserve.native as native
from radixserve.model.config import ModelConfig
from radixserve.model.linear import F32Weight, Linear, PackedWeight
from radixserve.model.native_layers import NativeLayers
from radixserve.model.protocols import Collectives, LayerAttention
from radixserve.model.quant.groups import Groups
from radixserve.model.rotary import RotaryEmbedding, apply_rotary
from radixserve.model.shards import ModelShards


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


class Attention(nn.Module):
    use_native = False
    """Set by `DecoderModel.pack`: rotate q and k in place (`native/rotary.cpp`)."""
    rope_in_store = False
    """Set by `DecoderModel.fuse`: the backend rotates q and k as it stores K (`rope=`)."""

    def __init__(self, config: ModelConfig, layer: int, shards: ModelShards,
                 tp: Collectives | None) -> None:
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
                backend: LayerAttention, kv_cache: tuple[torch.Tensor, torch.Tensor]):
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
        out = self.o_proj(out.reshape(-1, self.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, shards: ModelShards, tp: Collectives | None) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.tp = tp
        self.gate_up_proj = Linear(config.hidden_size, (inter, inter), bias=config.mlp_bias,
                                   shard=shards.column())
        self.down_proj = Linear(inter, config.hidden_size, bias=config.mlp_bias,
                                shard=shards.row())
        self.silu_mul: Callable[[torch.Tensor], torch.Tensor] = silu_mul  # fuse(): Triton's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.silu_mul(self.gate_up_proj(x)))
        return out if self.tp is None else self.tp.all_reduce(out)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) x up of the fused gate/up projection's output (gate first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, shards: ModelShards,
                 tp: Collectives | None) -> None:
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

    def __init__(self, config: ModelConfig, max_positions: int,
                 tp: Collectives | None = None) -> None:
        """`tp`: this rank's group; None or a group of one rank: the whole model, whose
        steps call no collective."""
        super().__init__()
        self.config = config
        self.tp = tp if tp is not None and tp.world > 1 else None
        rank, world = (self.tp.rank, self.tp.world) if self.tp is not None else (0, 1)
        self.shards = shards = ModelShards.of(config, rank, world)
        self.embed_tokens = nn.Embedding(shards.vocab_rows, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, shards, self.tp)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, max_positions)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, shards.vocab_rows, bias=False)
        self.packed_head: PackedWeight | None = None
        self._native: NativeLayers | None | bool = False
        """The layers in one native call where this model is that case (`native_layers.py`),
        decided at the first forward (once LoRA slots are attached); False: not yet."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                logit_rows: torch.Tensor, backend: LayerAttention,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        x = self.embed_tokens(input_ids) if self.tp is None else self._embed_shard(input_ids)
        if self._native is False:
            self._native = NativeLayers.of(self, silu_mul)
        if isinstance(self._native, NativeLayers) and (logits := self._native.run(
                x, positions, backend, kv_caches, logit_rows)) is not None:
            return logits  # the layers and the head in one native call (one rank)
        rope = self.rotary(positions, x.dtype)
        delta = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            delta = layer(x, delta, rope, backend, kv_cache)
        x = self.norm(x[logit_rows], None if delta is None else delta[logit_rows])
        if self.packed_head is not None:
            logits = self.packed_head.matmul(x, None)
        else:
            logits = nn.functional.linear(x, self.head_weight)
        if self.tp is None:
            return logits
        # The last rank's range may hold fewer rows than the others (a GGUF head is cut
        # exactly): pad to a common width for the gather, then keep the vocabulary's.
        logits = nn.functional.pad(logits, (0, self.shards.vocab_rows - logits.shape[1]))
        gathered = self.tp.gather_columns(logits)
        return None if gathered is None else gathered[:, :self.config.vocab_size]

    def _embed_shard(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding of a rank's shard: this rank's rows of the vocabulary, the others'
        tokens adding zeros here, summed over the ranks."""
        assert self.tp is not None
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
        for layer in self.modules():
            if isinstance(layer, (RMSNorm, Attention)):
                layer.use_native = True
        if self.packed_head is None:
            self.set_head(F32Weight(self.head_weight))  # a tied head shares the embedding
        self._native = False  # decided afresh for the packed weights

    def fuse(self) -> None:
        """The residual add with RMSNorm, RoPE with the KV store (by a backend that
        `fuses_rope`) and SiLU x up through Triton (`kernels/fused.py`)."""
        from radixserve.kernels import fused  # imports triton: only on this path
        self._native = False
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
        LM head stay as loaded (`set_head` gives the head another format). For `q4`, a projection
        part whose Hugging Face name (`model.layers.0.self_attn.q_proj.weight`) is in `file_groups`
        takes those 4-bit groups as they are; the others are quantized from their float weights
        (every part, for `int8`), and their count is returned."""
        from_floats = 0
        self._native = False
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
