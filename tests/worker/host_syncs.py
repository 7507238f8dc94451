"""Counting the host's reads of tensor values (each a sync on a GPU), and sampling rows of
every kind, for the sampler's tests. Moved from bench/sampler_host.py, whose question (the
sampler's host cost before and after it moved onto the device) is answered
(bench/results/README.md)."""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from radixserve.messages import SeqSampling

SCALAR_READS = ("aten._local_scalar_dense", "aten.item")
"""What `.item()`, `bool()`, `int()` and `float()` of a tensor dispatch to: one sync each."""
COPIES = (torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy)
"""Whole-tensor reads by the host, which the dispatcher does not show for a CPU tensor."""


class _Reads(TorchDispatchMode):
    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if str(func.overloadpacket) in SCALAR_READS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


class _Copies(TorchFunctionMode):
    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func in COPIES:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


class HostSyncs:
    """Counts the host's reads of tensor values inside a `with` block, on any device: the
    scalar reads the dispatcher sees and the whole-tensor copies torch's function layer
    sees. On a GPU each is a sync; on a CPU they are the same calls, so a CPU test counts
    what a GPU step would wait for. `seen` names them in order."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self._modes = (_Copies(self.seen), _Reads(self.seen))

    def __enter__(self) -> HostSyncs:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    @property
    def count(self) -> int:
        return len(self.seen)


def mixed_params(batch: int, vocab: int) -> list[SeqSampling]:
    """`batch` rows cycling through greedy, top-k, top-p, min-p, the penalties (a 256-token
    prompt, 64 outputs) and all three filters, each with its own seed and step."""
    gen = torch.Generator().manual_seed(batch)
    kinds: list[dict[str, Any]] = [
        dict(temperature=0.0), dict(top_k=40, temperature=0.8), dict(top_p=0.9),
        dict(min_p=0.05, temperature=1.2),
        dict(frequency_penalty=0.4, presence_penalty=0.2, repetition_penalty=1.1,
             temperature=0.7),
        dict(top_k=50, top_p=0.95, min_p=0.02, temperature=0.9)]
    rows = []
    for i in range(batch):
        kind = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                **kinds[i % len(kinds)]}
        p = SeqSampling(seed=1000 + i, step=i % 7, **kind)
        if "repetition_penalty" in kind:
            p.prompt_ids = torch.randint(vocab, (256,), generator=gen).tolist()
            p.output_ids = torch.randint(vocab, (64,), generator=gen).tolist()
        rows.append(p)
    return rows
