"""The attention backends by name, and what each asks of the pool's KV layout."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from radixserve.worker.attention.gather_reads import GatherReads
from radixserve.worker.attention.registry import BACKENDS, create_backend
from radixserve.worker.attention.slot_reads import SlotReads
from radixserve.worker.attention.torch_backend import TorchAttentionBackend

CPU = torch.device("cpu")


@dataclass
class Layout:
    """A `KVLayout` whose two cache lists can be told apart."""

    slot_views: bool
    contiguous: bool
    layers: list = field(default_factory=lambda: [("slots k", "slots v")])
    block_layers: list = field(default_factory=lambda: [("blocks k", "blocks v")])


def test_names() -> None:
    assert set(BACKENDS) == {"torch", "triton"}
    assert isinstance(create_backend("auto", CPU), TorchAttentionBackend)
    with pytest.raises(ValueError, match="torch, triton or auto"):
        create_backend("flash", CPU)


def test_torch_reads_the_slots_views_in_place_where_the_layout_has_them() -> None:
    virtual = Layout(slot_views=True, contiguous=True)
    backend = create_backend("torch", CPU, virtual)
    assert isinstance(backend.reads, SlotReads)
    assert backend.kv_caches(virtual) is virtual.layers
    paged = Layout(slot_views=False, contiguous=False)
    backend = create_backend("torch", CPU, paged)
    assert isinstance(backend.reads, GatherReads)
    assert backend.kv_caches(paged) is paged.block_layers
    assert isinstance(TorchAttentionBackend().reads, GatherReads)  # no layout: paged


def test_triton_reads_blocks_contiguous_where_the_layout_says() -> None:
    pytest.importorskip("triton")
    from radixserve.worker.attention.triton_backend import TritonAttentionBackend

    virtual = Layout(slot_views=True, contiguous=True)
    backend = create_backend("triton", CPU, virtual)
    assert isinstance(backend, TritonAttentionBackend) and backend.contiguous
    assert backend.kv_caches(virtual) is virtual.block_layers
    assert not TritonAttentionBackend().contiguous
