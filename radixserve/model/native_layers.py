"""A step's decoder layers and LM head in one native call (`native/decode_layers.cpp`).

At batch 1 on a small model the kernels of a layer take a fraction of a millisecond and the
interpreter around them (module calls, views, the kernels' Python wrappers, the backend's
store and read) about as much again: the default model's 30 layers are ~450 Python-level
calls a token. Where a step is the case that dominates CPU decode, the whole stack runs in
C++ calling the same kernels in the same order, so its output is bit for bit the module
path's.

That case, checked once per model (`NativeLayers.of`) and once per step (`run`): fp32 on a
CPU with the kernels built (`DecoderModel.pack` ran), every projection and the LM head a
dense fp32, `q4` or `int8` weight with no LoRA, one rank, no q/k norms, no sliding window,
and a step of decodes and extends (a prompt's chunk or uncached tail, a speculative step's
drafts: read causally in blocks of rows, `TorchAttentionBackend._causal_sets`), with or
without a tree-attention plan, that the attention backend reads in place
(`TorchAttentionBackend.native_decode_args`). Anything else returns None and the model runs
its modules as before."""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

import radixserve.native as native
from radixserve.model.linear import F32Weight, Linear
from radixserve.model.quant.int4 import Int4Weight
from radixserve.model.quant.int8 import Int8Weight

ENABLED = os.environ.get("RADIXSERVE_NATIVE_LAYERS", "1") != "0"
"""`RADIXSERVE_NATIVE_LAYERS=0` keeps the module path (comparisons, benchmarks)."""
ONE_REGION = os.environ.get("RADIXSERVE_NATIVE_ONE_REGION", "1") != "0"
"""Whether a native step whose projections take their GEMV paths (up to 128 tokens in fp32,
79 in q4 and int8) runs in one OpenMP region (a team meeting at a barrier after each
operation) rather than each kernel on torch's pool; the output is the same either way.
`RADIXSERVE_NATIVE_ONE_REGION=0` keeps the pool: on cores that other work holds, a team's
~240 barriers a token each wait for the slowest thread (a shared 2-core machine at load 4
measured the one region 0.70-0.93x the pool; quiet, 1.04-1.50x)."""


def _projection(linear: Linear) -> tuple[int, list[torch.Tensor]] | None:
    """The kernel's format code and tensors of a projection's packed weight, or None."""
    return None if linear.lora is not None else _packed(linear.packed)


def _packed(packed: object) -> tuple[int, list[torch.Tensor]] | None:
    """The kernel's format code and tensors of a packed weight, or None."""
    if isinstance(packed, F32Weight):
        return 0, [packed.weight]
    if isinstance(packed, Int4Weight):
        return 1, [packed.codes, packed.scale, packed.low]
    if isinstance(packed, Int8Weight):
        g = packed.groups
        return 2, [g.codes, g.scale, g.low]
    return None


class NativeLayers:
    """The model's layers, LM head and rotary tables bound to the native `DecoderLayers`
    once (the tensors shared, not copied): a step passes only its own."""

    def __init__(self, plan: Any) -> None:
        self.plan = plan

    @classmethod
    def of(cls, model: Any, silu_mul: Callable[..., Any],
           one_region: bool | None = None) -> NativeLayers | None:
        """The native layers of `model` (a `llama.DecoderModel`, whose MLPs run `silu_mul`
        unless Triton's replaced it), or None where its layers are not that case;
        `one_region` (default `ONE_REGION`): whether its steps run in one OpenMP region."""
        config = model.config
        if not ENABLED or model.tp is not None or config.qk_norm \
                or any(w is not None for w in config.layer_windows) or not native.available():
            return None
        norms: list[torch.Tensor] = []
        formats: list[int] = []
        weights: list[list[torch.Tensor]] = []
        biases: list[torch.Tensor | None] = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                if not _native_norm(norm, config.rms_norm_eps):
                    return None
                norms.append(norm.weight.data.float().contiguous())
            if not attn.use_native or attn.rope_in_store or mlp.silu_mul is not silu_mul:
                return None
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                projection = _projection(linear)
                if projection is None:
                    return None
                formats.append(projection[0])
                weights.append(projection[1])
                biases.append(None if linear.bias is None else linear.bias.data.contiguous())
        head = _packed(model.packed_head)
        if head is None or not _native_norm(model.norm, config.rms_norm_eps):
            return None
        norms.append(model.norm.weight.data.float().contiguous())
        formats.append(head[0])
        weights.append(head[1])
        biases.append(None)
        first = model.layers[0].self_attn
        plan = native.load().DecoderLayers(first.num_heads, first.num_kv_heads, first.head_dim,
                                           config.rms_norm_eps, first.scale, norms, formats,
                                           weights, biases, model.rotary.cos, model.rotary.sin,
                                           ONE_REGION if one_region is None else one_region)
        return cls(plan)

    def run(self, x: torch.Tensor, positions: torch.Tensor, backend: Any,
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
            logit_rows: torch.Tensor) -> torch.Tensor | None:
        """Every layer over the residual stream `x` (in place) of the tokens at `positions`,
        then the final norm and the LM head, if this step is the native case: the logits of
        `logit_rows`; else None (nothing run)."""
        args = getattr(backend, "native_decode_args", None)
        if args is None or x.dtype != torch.float32:
            return None
        step = args(kv_caches[0][0])
        if step is None:
            return None
        slots, (tables, starts, lens), row_offsets, rows = step
        return self.plan.step(x, positions.long(), slots, tables, starts, lens, row_offsets, rows,
                              [k for k, _ in kv_caches], [v for _, v in kv_caches],
                              logit_rows.long())


def _native_norm(norm: Any, eps: float) -> bool:
    """Whether an `RMSNorm` runs the native kernel the step calls, with the model's eps."""
    return norm.use_native and norm.fused is None and norm.eps == eps
