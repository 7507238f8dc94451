"""The libc memory-mapping calls the CPU virtual KV layout makes (`virtual_kv.py`): a
file's pages shared at an address, the zero reserve, guard pages, and unmapping."""

from __future__ import annotations

import ctypes
import os

_PROT_READ, _PROT_WRITE = 0x1, 0x2
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = \
    0x01, 0x02, 0x10, 0x20, 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _mmap(addr: int | None, size: int, prot: int, flags: int, fd: int, offset: int) -> int:
    out = _libc.mmap(addr, size, prot, flags, fd, offset)
    if out in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}")
    return out


def map_file(addr: int | None, size: int, fd: int, offset: int) -> int:
    """`size` bytes of file `fd` from `offset`, shared and writable, at `addr` (replacing
    what is there) or, None, where the kernel chooses; returns the address."""
    flags = _MAP_SHARED if addr is None else _MAP_SHARED | _MAP_FIXED
    return _mmap(addr, size, _PROT_READ | _PROT_WRITE, flags, fd, offset)


def map_zeros(addr: int | None, size: int) -> int:
    """`size` bytes of the zero reserve: anonymous, read-only memory that commits nothing
    (reads see the kernel's shared zero page, a write faults), at `addr` (replacing what
    is there) or, None, where the kernel chooses; returns the address."""
    flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE
    return _mmap(addr, size, _PROT_READ, flags if addr is None else flags | _MAP_FIXED, -1, 0)


def map_guard(addr: int, size: int) -> None:
    """`size` bytes at `addr` that no access may touch (`PROT_NONE`), in place of what is
    there: a VMA that never merges with its neighbours."""
    flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED
    _mmap(addr, size, 0, flags, -1, 0)


def munmap(addr: int, size: int) -> None:
    _libc.munmap(addr, size)
