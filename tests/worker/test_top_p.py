"""Top-p's floor (worker/top_p.py) equals the floor a sort of the whole vocabulary gives,
for rows whose nucleus is within the first `HEAD` tokens, rows whose nucleus is wider (sorted
whole), both in one batch, and ties at the cut-off."""

from __future__ import annotations

import pytest
import torch

from radixserve.worker.top_p import HEAD, top_p_floors


def sorted_floor(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    ordered = probs.sort(dim=-1, descending=True).values
    last = torch.searchsorted(ordered.cumsum(-1), top_p[:, None])
    return ordered.gather(-1, last.clamp(max=probs.shape[-1] - 1))[:, 0]


def rows(vocab: int, sharpness: list[float], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(sharpness), vocab, generator=g) * torch.tensor(sharpness)[:, None]
    return torch.softmax(logits, dim=-1)


@pytest.mark.parametrize("seed", range(5))
def test_the_floor_equals_the_sorted_floor(seed) -> None:
    # Sharp rows have their nucleus in the head, flat ones far past it.
    probs = rows(5000, [12.0, 0.1, 8.0, 0.5, 20.0, 0.01], seed)
    top_p = torch.tensor([0.9, 0.9, 0.5, 0.95, 0.99, 0.3])
    floors = top_p_floors(probs, top_p)
    assert torch.equal(floors, sorted_floor(probs, top_p))
    kept = (probs >= floors[:, None]).sum(-1)
    assert (kept[[0, 2, 4]] <= HEAD).all() and (kept[[1, 3]] > HEAD).all()


def test_ties_at_the_cut_off_all_stay() -> None:
    probs = torch.full((2, 1000), 1e-4)
    probs[:, :400] = 0.002  # 400 equal tokens hold 0.8: the nucleus ends among them
    probs /= probs.sum(-1, keepdim=True)
    top_p = torch.tensor([0.5, 0.7])
    floors = top_p_floors(probs, top_p)
    assert torch.equal(floors, sorted_floor(probs, top_p))
    assert ((probs >= floors[:, None]).sum(-1) == 400).all()


def test_a_vocabulary_within_the_head_is_sorted_whole() -> None:
    probs = rows(HEAD // 2, [1.0, 5.0], 3)
    top_p = torch.tensor([0.8, 0.9])
    assert torch.equal(top_p_floors(probs, top_p), sorted_floor(probs, top_p))
