"""Which device and dtype a worker (rank) runs on."""

from __future__ import annotations

import torch

from radixserve.worker.tensor_parallel import Placement

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str, placement: Placement = Placement()) -> torch.device:
    """The device `name` names; with several ranks on a host, `cuda` is each rank's own."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch sees no CUDA device")
    if device.type == "cuda" and placement.local_world > 1:
        if device.index is not None:
            raise ValueError(f"device {name!r} names one GPU, but {placement.local_world} "
                             "ranks run on this host: use device='cuda' (one GPU per rank)")
        if placement.local_world > torch.cuda.device_count():
            raise ValueError(f"{placement.local_world} ranks on this host need as many GPUs; "
                             f"torch sees {torch.cuda.device_count()}")
        device = torch.device("cuda", placement.local_rank)
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # CPUs here have no native bf16: it runs ~60x slower than fp32.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]
