"""The attention-backend interface the model calls, and what a backend asks of the KV layout.

The model knows this interface only; which backend runs is the worker's choice
(`registry.create_backend`). A backend gets the step's `AttentionMetadata` once per
forward, then for each layer stores the new tokens' K/V into the cache and returns their
attention output. A step whose metadata carries a cascade plan (`worker/cascade.py`) does
tree attention (`cascade_split.CascadeSplit`).

The KV layout is the pool's (`worker/kv_pool.py`: paged; `worker/virtual_kv.py`,
`worker/virtual_kv_cuda.py`: virtual): a backend is made for a layout and reads it only
through `KVLayout`, so no backend is written per layout.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol

import torch

from radixserve.worker.cascade import CascadePlan

LayerCaches = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer, its K and V caches."""


class KVLayout(Protocol):
    """What a backend asks of the pool's KV layout (the pools implement it)."""

    layers: LayerCaches
    """Per layer, K and V as blocks `[N, page_size, num_kv_heads, head_dim]` (any block
    stride; a block's rows, heads and head_dim packed) named by the step's block ids
    (`AttentionMetadata.block_tables`; `slot_mapping` is block * page_size + row)."""
    contiguous: bool
    """Each sequence's block ids (and each shared run's) are consecutive over blocks back
    to back, so a kernel reads its KV from the first id alone."""


@dataclass
class AttentionMetadata:
    """Where each sequence of a flat batch lives in the token stream and in the KV pool."""

    q_start: torch.Tensor
    """`[B+1]` int32: sequence b's tokens are `q_start[b]:q_start[b+1]`."""
    q_lens: torch.Tensor
    """`[B]` int32: new tokens of sequence b this step."""
    kv_lens: torch.Tensor
    """`[B]` int32: cached tokens of sequence b once this step's KV is stored."""
    block_tables: torch.Tensor
    """`[B, max_blocks]` int32: physical blocks of each sequence, in order (padded); in
    the virtual layout, blocks of the slots' views (`VirtualKVPool.view_tables`)."""
    slot_mapping: torch.Tensor
    """`[T]` int64: the slot (block * page_size + offset) of each new token's KV."""
    max_q_len: int
    max_kv_len: int
    page_size: int
    cascade: CascadePlan | None = None
    """The step's shared block runs (tree attention), or None: every sequence alone (its
    block ids named as in `block_tables`)."""
    kinds: SeqKinds | None = None
    """The step's sequences by kind, as the worker found them on the host (`StepSeqs`);
    None: a backend that needs them finds them from `q_lens` (`SeqKinds.of`)."""
    lengths: StepLengths | None = None
    """`q_lens` and `kv_lens` as the host knows them (the worker's steps carry them), for
    what a backend sizes or indexes on the host (tree attention's split); None: read back
    from the device where needed (`host_lengths`)."""

    @property
    def num_seqs(self) -> int:
        return self.q_lens.shape[0]

    def seq_kinds(self) -> SeqKinds:
        """`kinds`, or found from `q_lens` where the caller gave none."""
        return self.kinds if self.kinds is not None else SeqKinds.of(self.q_lens)

    def host_lengths(self) -> StepLengths:
        """`lengths`, or read back from the device (a host sync: callers without them,
        such as the kernels' tests)."""
        if self.lengths is not None:
            return self.lengths
        return StepLengths(self.q_lens.tolist(), self.kv_lens.tolist())


@dataclass
class StepLengths:
    """The step's new tokens and contexts per sequence, on the host."""

    q_lens: list[int]
    kv_lens: list[int]

    @functools.cached_property
    def q_start(self) -> list[int]:
        return [0, *accumulate(self.q_lens)]

    def rows(self, seqs: list[int]) -> list[int]:
        """The token-stream rows of `seqs`, sequence by sequence."""
        return [t for s in seqs for t in range(self.q_start[s], self.q_start[s + 1])]


@dataclass
class SeqKinds:
    """A step's sequences by kind, for the backends that run decodes and extends apart:
    indices (`[D]`, `[E]` int32 or int64 on the device) of those with one new token and of the
    others. Their sizes are known on the host: splitting a mixed step reads nothing back."""

    decode: torch.Tensor
    extend: torch.Tensor

    @classmethod
    def of(cls, q_lens: torch.Tensor) -> SeqKinds:
        """Found on `q_lens`' device: a host sync on a GPU (`nonzero`), for callers
        without the host's lengths (kernel tests, benchmarks); the worker's steps carry
        theirs (`AttentionMetadata.kinds`)."""
        single = q_lens == 1
        return cls(torch.nonzero(single).flatten(), torch.nonzero(~single).flatten())


def active_window(meta: AttentionMetadata, window: int | None) -> int | None:
    """`window`, or None when no context of the step is longer than it (then it masks
    nothing: every query reads all its keys)."""
    return None if window is None or window >= meta.max_kv_len else window


class AttentionBackend(ABC):
    """Attention for one forward step over the caches of the layout it was made with
    (`KVLayout.layers`, which the model passes layer by layer; `layout=None`: the paged
    one)."""

    meta: AttentionMetadata
    """The step's metadata, from `begin_forward`."""

    @abstractmethod
    def __init__(self, layout: KVLayout | None = None) -> None:
        """Ask `layout` what this backend reads (once: nothing per step or layer)."""

    @abstractmethod
    def begin_forward(self, meta: AttentionMetadata) -> None:
        """Called once per step before the first layer: keep `meta` and precompute what
        layers share."""

    supports_window = False
    """Whether `forward` honours `window` (else the worker picks a backend that does)."""
    graph_capturable = False
    """Whether a decode step's `begin_forward` and `forward` can be captured in a CUDA graph
    (`worker/cuda_graph.py`): no host sync, nothing sized by the values of the step's
    tensors (the torch backend reads lengths back and builds index tensors per step)."""
    timed_natively = True
    """Whether timing this backend says what it costs on its device (not the Triton
    kernels under the interpreter, which run thousands of times slower than compiled):
    where it does not, tree attention's cost model takes its documented defaults
    (`worker/cascade_cost.py`) instead of measuring at start-up."""
    fuses_rope = False
    """Whether `forward` takes `rope`: q and k unrotated, rotated as K is stored (one kernel
    instead of two passes; the model then runs its other fused kernels, `DecoderModel.fuse`)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                window: int | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Store `k`, `v` (`[T, Hkv, D]`) at the step's slots, then attend.

        `q`: `[T, H, D]`; returns `[T, H, D]`. `window`: the layer's sliding window (a
        query at position i reads only keys i-window+1 .. i), or None. `rope`: each token's
        cos and sin (`[T, 1, D]`) when q and k come unrotated (only where `fuses_rope`):
        q is rotated in place, and K stored rotated.
        """


