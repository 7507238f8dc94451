"""This machine's cache directory, shared by the model loader (converted models) and
native/ (the kernels' builds), which sits below it, and the lock their builders take."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


def cache_root() -> Path:
    """`$RADIXSERVE_CACHE`, else `~/.cache/radixserve`: where converted models and the
    native kernels' builds live."""
    env = os.environ.get("RADIXSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "radixserve"


@contextlib.contextmanager
def locked(lock_path: Path) -> Iterator[None]:
    """Held by one process at a time, and freed by the kernel when its holder dies: the
    holder is the only builder alive, so what a killed build left behind is its to clear."""
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
