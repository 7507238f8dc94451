"""The disk tier's directory: what each file is called. Shared by the scheduler's side (the
tree's index, cache/persist.py) and the worker's (the KV files, worker/kv_disk.py), which
otherwise know nothing of each other."""

from __future__ import annotations

import os
from pathlib import Path

ENTRY_SUFFIX = ".kv"
INDEX_NAME = "index.msgpack"
LOCK_NAME = "lock"
"""Held (flock) by the one scheduler that uses the directory."""


def entry_dirs(directory: Path, tp_size: int = 1) -> list[Path]:
    """Where the KV files are: `directory` itself, or under tensor parallelism one folder
    per rank (`rank0`, `rank1`, ...), each with its heads' share of every entry. An entry
    is whole only where every rank's file is."""
    return [directory] if tp_size == 1 else [directory / f"rank{r}" for r in range(tp_size)]


def entry_path(directory: Path, entry: int) -> Path:
    return directory / f"{entry:016x}{ENTRY_SUFFIX}"


def entry_of(path: Path) -> int | None:
    """The entry a KV file's name names, or None for any other file."""
    if path.suffix != ENTRY_SUFFIX:
        return None
    try:
        return int(path.stem, 16)
    except ValueError:
        return None


def fsync_dir(directory: Path) -> None:
    """Make the renames done in `directory` survive a crash."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
