"""A fake `cuda.bindings.driver` for the virtual KV layout's tests without a GPU
(`tests/worker/test_virtual_kv_cuda*.py`): CUDA's VMM calls over host memory, with the
driver's rules asserted, the H200's refusal of a non-zero offset into a handle among them."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import types

GRANULE = 64 << 10
"""The fake driver's granule (CUDA's is 2 MiB on Hopper; small keeps the test small)."""
PROT_NONE, MAP_FIXED = 0, 0x10


class FakeDriver:
    """The `cuda.bindings.driver` calls the pool makes, over host memory, with CUDA's
    rules asserted: every breach is an AssertionError in the test."""

    CUresult = types.SimpleNamespace(CUDA_SUCCESS=0)
    CUdeviceptr = int
    CUmemAllocationType = types.SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
    CUmemLocationType = types.SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
    CUmemAllocationGranularity_flags = types.SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0)
    CUmemAccess_flags = types.SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)

    def __init__(self):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.mmap.restype = ctypes.c_void_p
        self.libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                   ctypes.c_int, ctypes.c_int, ctypes.c_long]
        self.reserved: dict[int, int] = {}  # address -> bytes
        self.mapped: dict[int, int] = {}  # address -> bytes
        self.accessible: set[int] = set()
        self.handles: dict[int, int] = {}  # handle (an fd) -> bytes
        self.created = self.maps = 0
        self.gate: threading.Event | None = None
        """Set by a test: a map made off the main thread waits for it (a slow driver)."""

    @staticmethod
    def CUmemAllocationProp():  # noqa: N802 - the driver's names
        return types.SimpleNamespace(location=types.SimpleNamespace())

    @staticmethod
    def CUmemAccessDesc():  # noqa: N802
        return types.SimpleNamespace(location=types.SimpleNamespace())

    def cuGetErrorName(self, err):  # noqa: N802
        return 0, b"FAKE_ERROR"

    def cuMemGetAllocationGranularity(self, prop, flags):  # noqa: N802
        return 0, GRANULE

    def cuMemCreate(self, size, prop, flags):  # noqa: N802
        assert size % GRANULE == 0
        fd = os.memfd_create("fake-cuda")
        os.ftruncate(fd, size)
        self.handles[fd] = size
        self.created += 1
        return 0, fd

    def _mmap(self, addr, size, prot, flags, fd=-1, offset=0):
        out = self.libc.mmap(addr, size, prot, flags, fd, offset)
        assert out not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        return out

    def cuMemAddressReserve(self, size, alignment, addr, flags):  # noqa: N802
        assert size % GRANULE == 0 and alignment == GRANULE
        # Over-reserved by a granule, the aligned part used (the rest stays reserved).
        out = self._mmap(None, size + alignment, PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        out = -(-out // alignment) * alignment
        self.reserved[out] = size
        return 0, out

    def _inside_reservation(self, addr, size):
        return any(lo <= addr and addr + size <= lo + n for lo, n in self.reserved.items())

    def cuMemMap(self, ptr, size, offset, handle, flags):  # noqa: N802
        # The H200's driver refuses any other offset (CUDA_ERROR_NOT_SUPPORTED): whole
        # handles only.
        assert offset == 0 and size == self.handles[handle], "cuMemMap of part of a handle"
        assert ptr % GRANULE == 0, "cuMemMap at an unaligned address"
        assert self._inside_reservation(ptr, size), "mapping outside a reservation"
        if self.gate is not None and threading.current_thread() is not threading.main_thread():
            assert self.gate.wait(10)
        assert not any(a < ptr + size and ptr < a + n for a, n in self.mapped.items()), \
            "cuMemMap onto an address that is mapped"
        self._mmap(ptr, size, PROT_NONE, mmap.MAP_SHARED | MAP_FIXED, handle, offset)
        self.mapped[ptr] = size
        self.maps += 1
        return (0,)

    def cuMemSetAccess(self, ptr, size, desc, count):  # noqa: N802
        assert self.mapped.get(ptr) == size, "access set on something not one mapping"
        assert desc[0].flags == 3 and count == 1
        assert self.libc.mprotect(ctypes.c_void_p(ptr), size, mmap.PROT_READ | mmap.PROT_WRITE) == 0
        self.accessible.add(ptr)
        return (0,)

    def cuMemUnmap(self, ptr, size):  # noqa: N802
        assert self.mapped.pop(ptr, None) == size, "cuMemUnmap of less or more than a mapping"
        self.accessible.discard(ptr)
        self._mmap(ptr, size, PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED)
        return (0,)

    def cuMemAddressFree(self, ptr, size):  # noqa: N802
        assert self.reserved.pop(ptr) == size
        assert not any(ptr <= a < ptr + size for a in self.mapped), "freed while mapped"
        return (0,)

    def cuMemRelease(self, handle):  # noqa: N802
        os.close(handle)
        del self.handles[handle]
        return (0,)
