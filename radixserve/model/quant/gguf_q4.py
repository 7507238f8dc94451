"""A GGUF's own 4-bit blocks (Q4_0, Q4_1, Q4_K) as `Groups`, with no rounding at all.

Each format's group of 32 is code * scale + low (`groups.py`) with the file's own numbers:
- Q4_0: d * (q - 8): scale d, low -8d;
- Q4_1: d * q + m: scale d, low m;
- Q4_K: per 32-input sub-block j of a 256 super-block, d * sc_j * q - dmin * m_j: scale
  d * sc_j, low -dmin * m_j (each an fp16 times a 6-bit integer: exact in fp32).
Every product code * scale is exact in fp32 too, so the kernel's value (one rounding of
code * scale + low) is gguf's own dequantization, bit for bit.
"""

from __future__ import annotations

from pathlib import Path
import numpy as np
import torch

from radixserve.model.quant.groups import Groups

FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """`[..., 16]` bytes -> `[..., 32]` codes: low nibbles first, then high ones (ggml's
    order within a 32-value run)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def fp16_field(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of every block (`[..., block bytes]` uint8), as fp32."""
    return blocks[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def block_groups(data: np.ndarray, kind: str) -> Groups:
    """`data`: a tensor's raw blocks, `[rows, bytes per row]` uint8 (gguf's reader)."""
    rows = data.shape[0]
    if kind in ("Q4_0", "Q4_1"):
        head = 2 if kind == "Q4_0" else 4
        blocks = data.reshape(rows, -1, head + 16)
        scale = fp16_field(blocks, 0)
        low = -8 * scale if kind == "Q4_0" else fp16_field(blocks, 2)
        codes = _nibbles(blocks[..., head:])
    elif kind == "Q4_K":
        from gguf.quants import Q4_K

        blocks = data.reshape(rows, -1, 144)  # d, dmin, 12 bytes of 6-bit scales, 128 of codes
        n = blocks.shape[1]
        d, dmin = fp16_field(blocks, 0), fp16_field(blocks, 2)
        sc, mn = Q4_K.get_scale_min(blocks[..., 4:16].reshape(rows * n, 12))
        scale = d[..., None] * sc.reshape(rows, n, 8).astype(np.float32)
        low = -dmin[..., None] * mn.reshape(rows, n, 8).astype(np.float32)
        # Four runs of 64 inputs: 32 bytes, low nibbles the first 32 (sub-block 2j),
        # high nibbles the next 32 (sub-block 2j + 1).
        qs = blocks[..., 16:].reshape(rows, n, 4, 32)
        codes = np.stack([qs & 0x0F, qs >> 4], axis=3)  # [rows, n, 4, 2, 32]
        scale, low = scale.reshape(rows, -1), low.reshape(rows, -1)
    else:
        raise ValueError(f"{kind} is not a 4-bit GGUF type ({', '.join(FOUR_BIT)})")
    return Groups(torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, -1)),
                  torch.from_numpy(np.ascontiguousarray(scale.reshape(rows, -1))),
                  torch.from_numpy(np.ascontiguousarray(low.reshape(rows, -1))))


def read_q4_tensors(gguf_path: Path, heads: int, kv_heads: int) -> dict[str, Groups]:
    """The file's 4-bit projection weights by Hugging Face name (`model.layers.0.self_attn.
    q_proj.weight`), with llama.cpp's q/k rotary row order undone as the converter does
    (`loader.unpermute_rows`: whole rows move, so each row's blocks go with it). Tensors of
    other types are left out: the caller quantizes those from their float values."""
    import gguf

    from radixserve.model.gguf_names import gguf_hf_name, unpermute_rows

    reader = gguf.GGUFReader(gguf_path)
    arch = reader.fields["general.architecture"].contents()
    out: dict[str, Groups] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in FOUR_BIT or t.name == "rope_freqs.weight":
            continue
        name, n = gguf_hf_name(t.name, arch, heads, kv_heads)
        if not name.endswith("_proj.weight"):  # embedding and head: as the file has them
            continue
        groups = block_groups(np.asarray(t.data), kind)
        if n is not None:
            groups = groups.rows(torch.from_numpy(unpermute_rows(
                np.arange(groups.codes.shape[0]), n)))
        out[name] = groups
    return out

