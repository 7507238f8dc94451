"""Host-to-device copies on a step's path, in one place (issue 52).

A copy from pageable host memory (`torch.tensor(...).to(dev)`) is synchronous on a GPU:
the host waits for the copy, queued behind whatever the device still runs, so a step
launched while the previous one runs (overlap) would wait for it. `to_device` is the one
way the worker's step path sends host values (lists, numpy arrays, CPU tensors) to its
device. On CUDA it writes them into a pinned staging buffer and copies with
`non_blocking=True`: the host goes on at once. A buffer is reused only once the event
recorded behind its copy has completed (`StagingRing`): until then it may still be being
read, so a busy ring grows a new buffer rather than wait. On the CPU it is the plain
tensor, as before (a numpy array's memory shared, nothing copied twice).

tests/worker/test_staging.py checks the ring's reuse rule with fake events and that no
step-path module copies to a device any other way.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable, Protocol, Sequence

import numpy as np
import torch


class Event(Protocol):
    def record(self) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class StagingRing:
    """Pinned host buffers, used in turn: a copy takes the oldest buffer whose last copy
    has completed (its event), or a new one while fewer than `limit` are out; only past
    the limit does it wait for the oldest (a step with that many copies in flight)."""

    def __init__(self, make_buffer: Callable[[int], torch.Tensor],
                 make_event: Callable[[], Event], limit: int = 64) -> None:
        self.make_buffer, self.make_event, self.limit = make_buffer, make_event, limit
        self.buffers: deque[tuple[torch.Tensor, Event | None]] = deque()
        """Oldest use first: (uint8 buffer, the event behind its last copy)."""
        self.lock = threading.Lock()
        self.waits = 0
        """How often a copy had to wait for a buffer (the limit reached)."""

    def take(self, nbytes: int) -> torch.Tensor:
        """A free buffer of at least `nbytes` (its first `nbytes` for the caller to fill
        and copy from; then `release` with the copy queued)."""
        if self.buffers:
            buffer, event = self.buffers[0]
            if event is None or event.query():
                self.buffers.popleft()
                return buffer if buffer.numel() >= nbytes else self._new(nbytes)
            if len(self.buffers) >= self.limit:
                self.waits += 1
                event.synchronize()
                self.buffers.popleft()
                return buffer if buffer.numel() >= nbytes else self._new(nbytes)
        return self._new(nbytes)

    def release(self, buffer: torch.Tensor) -> None:
        """`buffer`'s copy is queued: an event behind it says when it may be reused."""
        event = self.make_event()
        event.record()
        self.buffers.append((buffer, event))

    def _new(self, nbytes: int) -> torch.Tensor:
        return self.make_buffer(max(4096, 1 << (nbytes - 1).bit_length()))

    def copy(self, host: np.ndarray, device: torch.device) -> torch.Tensor:
        """`host` on `device`, copied from a pinned buffer without waiting."""
        with self.lock:
            buffer = self.take(host.nbytes)
            staged = buffer[:host.nbytes]
            staged.numpy()[:] = host.reshape(-1).view(np.uint8)
            out = staged.view(_TORCH[host.dtype]).view(host.shape).to(device, non_blocking=True)
            self.release(buffer)
        return out


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32,
          torch.bool: np.bool_, torch.uint8: np.uint8}
_TORCH = {np.dtype(v): k for k, v in _NUMPY.items()}
_rings: dict[torch.device, StagingRing] = {}
_rings_lock = threading.Lock()


def _ring(device: torch.device) -> StagingRing:
    with _rings_lock:
        ring = _rings.get(device)
        if ring is None:
            ring = _rings[device] = StagingRing(
                lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True),
                lambda: torch.cuda.Event())
        return ring


def host_array(values: Any, dtype: torch.dtype) -> np.ndarray:
    """`values` (a list, nested lists, a numpy array, a CPU tensor) as a contiguous numpy
    array of `dtype`."""
    if isinstance(values, torch.Tensor):
        values = values.numpy()
    return np.ascontiguousarray(values, dtype=_NUMPY[dtype])


def to_device(values: np.ndarray | torch.Tensor | Sequence[Any], device: torch.device | str,
              dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`values` as a `dtype` tensor on `device`: on CUDA through a pinned staging buffer
    and a `non_blocking` copy (`StagingRing`), elsewhere the host tensor itself."""
    device = torch.device(device)
    if device.type != "cuda":
        if isinstance(values, torch.Tensor):
            return values.to(dtype)
        if isinstance(values, np.ndarray):
            return torch.from_numpy(values.astype(_NUMPY[dtype], copy=False))
        return torch.tensor(values, dtype=dtype)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _ring(device).copy(host_array(values, dtype), device)
