"""What the model asks of the worker that runs it, as protocols, so that model/ imports
nothing of worker/ (which builds the model): an attention backend for each layer's
attention (worker/attention/base.py's AttentionBackend satisfies `LayerAttention`) and,
under tensor parallelism, the rank's group (worker/tensor_parallel.py's TPGroup satisfies
`Collectives`)."""

from __future__ import annotations

from typing import Protocol

import torch


class LayerAttention(Protocol):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                window: int | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Store `k`, `v` at the step's slots, then attend (AttentionBackend.forward);
        `rope`: cos and sin, for a backend that rotates q and k as it stores."""
        ...


class Collectives(Protocol):
    """A tensor-parallel group of more than one rank: the model is given none with one
    rank, so a one-rank step makes no collective call at all."""

    rank: int
    world: int

    def all_reduce(self, t: torch.Tensor, op: str = "SUM") -> torch.Tensor: ...

    def gather_columns(self, t: torch.Tensor) -> torch.Tensor | None: ...
