"""A GGUF's Q8_0 tensor (the default model's tied embedding and LM head) as `Int8Weight`:
the file's int8 codes and, per 32 inputs, its fp16 scale in fp32, so that the kernel's
values are the file's exactly (d * q, exact in fp32). 1.06 bytes a weight against the
dense fp32 head's 4."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from radixserve.model.quant.gguf_q4 import fp16_field
from radixserve.model.quant.int8 import Int8Weight


def q8_0_weight(data: np.ndarray) -> Int8Weight:
    """`data`: a Q8_0 tensor's raw blocks, `[rows, bytes per row]` (gguf's reader)."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, 34)  # an fp16 d, then 32 int8 codes
    codes = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(rows, -1)
    return Int8Weight(codes, torch.from_numpy(fp16_field(blocks, 0)))


def read_q8_head(gguf_path: Path) -> Int8Weight | None:
    """The file's LM head (`output.weight`, else the tied `token_embd.weight`, as the
    converter decides) where it is Q8_0; None for any other type."""
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
    head = tensors.get("output.weight") or tensors["token_embd.weight"]
    if head.tensor_type != gguf.GGMLQuantizationType.Q8_0:
        return None
    return q8_0_weight(np.asarray(head.data))
