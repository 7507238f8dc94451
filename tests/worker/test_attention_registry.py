"""The attention backends by name, and what each asks of the pool's KV layout."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from radixserve.worker.attention.registry import BACKENDS, create_backend
from radixserve.worker.attention.torch_backend import TorchAttentionBackend

CPU = torch.device("cpu")


@dataclass
class Layout:
    """A `KVLayout` whose caches are told apart by name."""

    contiguous: bool
    layers: list = field(default_factory=lambda: [("blocks k", "blocks v")])


def test_names() -> None:
    assert set(BACKENDS) == {"torch", "triton"}
    assert isinstance(create_backend("auto", CPU), TorchAttentionBackend)
    with pytest.raises(ValueError, match="torch, triton or auto"):
        create_backend("flash", CPU)


def test_triton_reads_blocks_contiguous_where_the_layout_says() -> None:
    pytest.importorskip("triton")
    from radixserve.worker.attention.triton_backend import TritonAttentionBackend

    virtual = Layout(contiguous=True)
    backend = create_backend("triton", CPU, virtual)
    assert isinstance(backend, TritonAttentionBackend) and backend.contiguous
    assert not TritonAttentionBackend().contiguous
