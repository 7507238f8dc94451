"""This machine's cache directory, shared by the model loader (converted models) and
native/ (the kernels' builds), which sits below it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$RADIXSERVE_CACHE`, else `~/.cache/radixserve`: where converted models and the
    native kernels' builds live."""
    env = os.environ.get("RADIXSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "radixserve"
