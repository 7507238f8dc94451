"""A step's one wait for the device: what its answer needs, read back together.

On a GPU every read of a device value makes the host wait for the device's queue up to it.
With overlap the next step is queued behind this one before this one's answer is read,
so a plain `.tolist()` in `collect` would wait for the next step as well. A `Readback` is
started when the step is launched, right after its last kernel: each tensor copied into
pinned host memory (`non_blocking`) and an event recorded behind the copies; `wait`, in
`collect`, waits for that event alone and turns the copies into lists. On the CPU the
values are there already. A plain decode step makes exactly one (its sampled tokens and any
logprobs), which tests/worker/test_host_syncs.py counts.
"""

from __future__ import annotations

from typing import Any

import torch


class Readback:
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.event: torch.cuda.Event | None = None
        if tensors and tensors[0].device.type == "cuda":
            self.host = [t.to("cpu", non_blocking=True) for t in tensors]  # into pinned memory
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tensors

    def wait(self) -> list[Any]:
        """Each tensor's values (`tolist`), in order: the step's one wait."""
        if self.event is not None:
            self.event.synchronize()
        return [t.tolist() for t in self.host]
