"""How the torch backend reads a step's cached K/V: the one place its layouts differ.

`TorchAttentionBackend` does a step the same way in every layout (store, plain and tree
attention, the log-sum-exp merge); what it asks of a `KVReads` is only each attention
call over the cached keys. `GatherReads` gathers them by block table (the paged layout, or
any blocks the tables name); `SlotReads` reads them in place from the slots' views (the
virtual layout, `KVLayout.slot_views`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from radixserve.worker.attention.base import AttentionMetadata
from radixserve.worker.attention.cascade_split import CascadeSplit, SeqSubset

Attended = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""`[T, H, D]` output in q's dtype, or with `return_lse` the fp32 output and `[T, H]`
log-sum-exp."""


class KVReads(ABC):
    """The attention calls of one step over one layer's caches (`k_cache`, `v_cache` as
    `KVLayout.layers` gives them), with what the layers share made once in `begin`."""

    @abstractmethod
    def begin(self, meta: AttentionMetadata, split: CascadeSplit) -> None:
        """Once per step, before the first layer."""

    @abstractmethod
    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               subset: SeqSubset, name: str, scale: float, window: int | None,
               return_lse: bool = False) -> Attended:
        """Single-token sequences `subset` (`name`: "plain", the split's `decode`, or
        "own", its `own_decode`), `q` their rows."""

    @abstractmethod
    def extend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               subset: SeqSubset, scale: float, window: int | None,
               return_lse: bool = False) -> Attended:
        """Multi-token sequences `subset`, `q` the step's rows (all of them), causally."""

    @abstractmethod
    def shared_runs(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    level: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Cascade level `level`'s shared-run pass: fp32 output and log-sum-exp of its
        rows (`CascadeLevelTensors.rows`)."""
