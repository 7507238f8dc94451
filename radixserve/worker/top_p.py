"""Top-p's floor per row: the smallest probability the nucleus keeps.

The nucleus is the row's largest probabilities while the mass strictly before each is
below top_p (the first always stays), so its floor is found in the row's probabilities in
descending order. Sorting the whole vocabulary for that is the costly part of a sampled
step on the CPU (64 rows x 49,152 took longer than the model's step); the nucleus of a
trained model's distribution is a few hundred tokens at most. So on the CPU the largest
`HEAD` of each row come first, by a partial selection, and only the rows whose `HEAD`
largest do not reach their top_p are sorted whole. The floor is the same either way: the
head is the sorted row's prefix, and a scan's first sums are the same numbers.

On a GPU every row is sorted: deciding which rows need more would read a value back and
make the host wait for the device, and the device sorts the vocabulary quickly.
"""

from __future__ import annotations

import numpy as np
import torch

HEAD = 256
"""The largest probabilities taken first on the CPU."""
HEAD_DEVICES = frozenset({"cpu"})
"""Devices whose tensors the host reads without waiting: there the head comes first."""


def _floor(descending: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's floor, the index of its last kept token) in rows given in descending
    order; an index at the width means the rows' values do not reach top_p."""
    last = torch.searchsorted(descending.cumsum(-1), top_p[:, None])[:, 0]
    floor = descending.gather(-1, last.clamp(max=descending.shape[-1] - 1)[:, None])[:, 0]
    return floor, last


def top_p_floors(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`[R]`: the smallest probability each row of `probs` `[R, V]` keeps under its
    `top_p` `[R]` (a token at it stays, ties included)."""
    width = min(HEAD, probs.shape[-1])
    if probs.device.type not in HEAD_DEVICES or width == probs.shape[-1]:
        return _floor(probs.sort(dim=-1, descending=True).values, top_p)[0]
    floor, last = _floor(probs.topk(width, dim=-1).values, top_p)
    # A CPU tensor's values are in host memory: reading them waits for nothing.
    short = torch.from_numpy(np.flatnonzero(last.numpy() >= width))
    if len(short):
        floor[short] = _floor(probs[short].sort(dim=-1, descending=True).values,
                              top_p[short])[0]
    return floor
