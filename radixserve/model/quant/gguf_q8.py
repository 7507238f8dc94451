"""A GGUF's Q8_0 tensor (the default model's tied embedding and LM head) as `Int8Weight`.

A Q8_0 block is d * q, q an int8, per 32 inputs: in `Groups`' form that is code q + 128,
scale d and low -128 d (as Q4_0's d * (q - 8) is low -8d). Both are exact in fp32 (an fp16
d times an integer of at most 8 bits), and so is q * d, the one rounding of code * scale
+ low: the kernel's values are the file's, bit for bit. 1.25 bytes a weight against the
dense fp32 head's 4."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from radixserve.model.quant.gguf_q4 import fp16_field
from radixserve.model.quant.groups import Groups
from radixserve.model.quant.int8 import Int8Weight


def q8_0_weight(data: np.ndarray) -> Int8Weight:
    """`data`: a Q8_0 tensor's raw blocks, `[rows, bytes per row]` (gguf's reader)."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, 34)  # an fp16 d, then 32 int8 codes
    codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    scale = fp16_field(blocks, 0)
    return Int8Weight(Groups(torch.from_numpy(codes.reshape(rows, -1)),
                             torch.from_numpy(scale), torch.from_numpy(-128 * scale)))


def read_q8_head(gguf_path: Path) -> Int8Weight | None:
    """The file's LM head (`output.weight`, else the tied `token_embd.weight`, as the
    converter decides) where it is Q8_0; None for any other type."""
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
    head = tensors.get("output.weight") or tensors["token_embd.weight"]
    if head.tensor_type != gguf.GGMLQuantizationType.Q8_0:
        return None
    return q8_0_weight(np.asarray(head.data))
