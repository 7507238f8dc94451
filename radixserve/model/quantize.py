"""`--quantization`: which projections of a loaded model run in which weight format.

`none` keeps the dense weights. `int8` and `q4` (8 or 4 bits per weight, a scale and low
per 32 inputs) hold every projection quantized; the embedding and the LM head stay as the
checkpoint has them: dense, except that `q4` on a GGUF whose head (or tied embedding, as
the default model's) is Q8_0 runs it as the file's Q8_0 codes and scales (under a third
of the fp32 head's bytes; the lookup table stays dense). `q4` on a
GGUF (the default model's Q4_1 file among them) takes the file's own Q4_0/Q4_1/Q4_K blocks
as they are; a projection the file holds in another type (Q6_K, Q8_0, F16...) is quantized
group-wise from its dequantized values, as every projection of a float checkpoint is.

Both formats run in fp32 through this project's CPU kernels (`radixserve/native`,
compiled once per machine): a quantized model computes what the fp32 model holding the
same weights dequantized does, up to rounding. Norms, attention and the residual stream
stay in the model's dtype.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from radixserve.model.config import ModelConfig
from radixserve.model.llama import DecoderModel
import radixserve.native as native
from radixserve.model.quant.groups import GROUP, check_shape

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class QuantizeReport:
    method: str
    weight_bytes: int
    """Bytes of all projections' weights (scales included) a token's forward reads."""
    head_bytes: int
    """Bytes of the LM head's weight, read once per step's logits rows."""
    head_format: str
    """`dense`, or `Q8_0`: a GGUF's Q8_0 head, its codes and scales as the file has them
    (`quant/gguf_q8.py`; `q4` only)."""
    file_parts: int
    """Projection parts (q, k, v, gate, ...) taken from a GGUF's own 4-bit blocks."""
    float_parts: int
    """Projection parts quantized here from float weights."""


def check_quantization(method: str, device: torch.device, config: ModelConfig,
                       tp_size: int = 1) -> None:
    """ValueError, before any weight is read, for a quantization this device or model
    cannot run (`method` is one of `config.QUANTIZATIONS`: the config checks that), and
    `native.BuildError` where this machine cannot build the kernels (built
    here, once per machine, if they are not yet)."""
    if method == "none":
        return
    if device.type != "cpu":
        raise ValueError(f"quantization={method!r} runs weight-only CPU kernels; "
                         f"none is wired for {device.type} devices: use quantization='none' "
                         "there, or device='cpu'")
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inter, hidden = config.intermediate_size, config.hidden_size
    for n, k in ((q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)):
        check_shape(n, k)
    for _, k in ((hidden, q), (hidden, inter)):  # row-parallel: inputs split over the ranks
        if k // tp_size % GROUP:
            raise ValueError(f"quantization={method!r} over tp_size={tp_size} ranks needs "
                             f"each rank's share of a row-parallel projection's inputs "
                             f"({k} / {tp_size}) divisible by {GROUP}")
    native.load()


def quantize_model(model: DecoderModel, method: str, model_name: str) -> QuantizeReport:
    """Put `model`'s loaded projections into `method`'s format (`model_name` as the Engine
    was given it: a GGUF's blocks are read from that file)."""
    from radixserve.model.loader import gguf_source
    from radixserve.model.quant.gguf_q4 import read_q4_tensors
    from radixserve.model.quant.gguf_q8 import read_q8_head
    from radixserve.model.quant.int8 import Int8Weight

    file_groups, head = None, None
    source = gguf_source(model_name) if method == "q4" else None
    if source is not None:
        file_groups = read_q4_tensors(source, model.config.num_heads, model.config.num_kv_heads)
        head = read_q8_head(source)
    float_parts = model.quantize(method, file_groups) if method != "none" else 0
    packed_head = None if head is None else Int8Weight(head.groups.rows(model.vocab_range))
    if packed_head is not None:
        model.set_head(packed_head)  # this rank's rows
    linears = model.linears().values()
    report = QuantizeReport(
        method, sum(m.weight_bytes for m in linears),
        model.head_weight.nbytes if packed_head is None else packed_head.nbytes,
        "dense" if head is None else "Q8_0",
        sum(len(m.parts) for m in linears) - float_parts if source is not None else 0,
        float_parts)
    if method != "none":
        logger.info("quantization %s: %.1f MB of projection weights (%d parts from the "
                    "file's 4-bit blocks, %d quantized at load), LM head %.1f MB %s",
                    method, report.weight_bytes / 1e6, report.file_parts, report.float_parts,
                    report.head_bytes / 1e6, report.head_format)
    return report
