"""A torch.profiler trace of the worker's forward steps, started and stopped by control
calls (SGLang's /start_profile and /stop_profile): the worker is where the time goes.

Both calls run in the thread that runs the steps, between two of them (EngineCore queues
them), so the trace holds whole steps; the steps it holds are the worker's step count at
`stop` less the count at `start`, so a step calls nothing here.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile


def default_output_dir() -> Path:
    return Path(tempfile.gettempdir()) / "radixserve-profiles"


class StepProfiler:
    def __init__(self, device: torch.device) -> None:
        self.activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(ProfilerActivity.CUDA)
        self._profile: Any = None
        self._output_dir: Path | None = None
        """Where the running trace goes (set by `start`)."""
        self._first_step = 0

    @property
    def running(self) -> bool:
        return self._profile is not None

    def start(self, output_dir: str | None, steps: int) -> dict[str, Any]:
        """`steps`: the worker's steps so far. Raises ValueError when a trace is already
        being recorded, or the folder cannot be made."""
        if self.running:
            raise ValueError("the worker is already being profiled: stop it first")
        # A server's output_dir is its profile directory or one name inside it, which is
        # made here, one level: never a caller's whole path (front_door/admin.py).
        folder = Path(output_dir) if output_dir else default_output_dir()
        try:
            folder.mkdir(parents=not output_dir, exist_ok=True)
        except OSError as e:
            raise ValueError(f"output_dir {str(folder)!r} cannot be made: {e}") from None
        self._output_dir, self._first_step = folder, steps
        self._profile = profile(activities=self.activities)
        self._profile.start()
        return {"profiling": True, "output_dir": str(folder)}

    def stop(self, steps: int) -> dict[str, Any]:
        """Ends the trace and writes it (Chrome trace JSON: chrome://tracing, Perfetto)."""
        if not self.running:
            raise ValueError("the worker is not being profiled: start it first")
        prof, self._profile = self._profile, None
        prof.stop()
        assert self._output_dir is not None
        path = self._output_dir / f"worker-{os.getpid()}-{time.time_ns()}.trace.json"
        prof.export_chrome_trace(str(path))
        return {"profiling": False, "output_dir": str(self._output_dir), "trace": str(path),
                "steps": steps - self._first_step}
