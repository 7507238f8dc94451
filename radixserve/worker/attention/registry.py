"""The attention backends by name, and the one function that makes one for a KV layout."""

from __future__ import annotations

from typing import Callable

import torch

from radixserve.worker.attention.base import AttentionBackend, KVLayout


def _torch() -> type[AttentionBackend]:
    from radixserve.worker.attention.torch_backend import TorchAttentionBackend
    return TorchAttentionBackend


def _triton() -> type[AttentionBackend]:
    # Imported only when chosen: it imports triton, and the kernels read
    # TRITON_INTERPRET when first imported.
    from radixserve.worker.attention.triton_backend import TritonAttentionBackend
    return TritonAttentionBackend


BACKENDS: dict[str, Callable[[], type[AttentionBackend]]] = {"torch": _torch, "triton": _triton}
"""Backend name -> its class (imported on first use); each is made as `cls(layout)`."""


def create_backend(name: str, device: torch.device,
                   layout: KVLayout | None = None) -> AttentionBackend:
    """The backend `name` reading `layout` (None: the paged one, caches given by the
    caller); `auto` picks triton on CUDA and torch elsewhere. ValueError for an unknown
    name."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} ({', '.join(BACKENDS)} or auto)")
    return BACKENDS[name]()(layout)
