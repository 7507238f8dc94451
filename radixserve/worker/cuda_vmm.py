"""The CUDA driver's virtual memory calls the virtual KV layout makes (`virtual_kv_cuda.py`),
through the `cuda-bindings` package (`pip install 'radixserve[cuda]'`).

Every mapping is a whole physical handle at offset 0: `cuMemMap` at a non-zero offset into
a handle is refused on the GPUs tried (`CUDA_ERROR_NOT_SUPPORTED` on an H200, driver 580;
the driver's documentation says the offset "currently must be zero"), so the pool's memory
is many handles, one per mapped unit, all created at start (`PageHandles`), never one big
one cut into pieces. vAttention does the same (one handle per page).
"""

from __future__ import annotations

import torch


def driver():
    """`cuda.bindings.driver`, or ValueError saying how to install it."""
    try:
        from cuda.bindings import driver as cu
    except ImportError as exc:
        raise ValueError("kv_layout='virtual' on CUDA needs the cuda-bindings package "
                         "(pip install 'radixserve[cuda]')") from exc
    return cu


def check(result):
    """The value(s) of a `cuda.bindings.driver` call, or RuntimeError naming its error."""
    cu = driver()
    err, *values = result
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise RuntimeError(f"CUDA driver: {name.decode() if name else err}")
    return values[0] if len(values) == 1 else values


def allocation_prop(device_index: int):
    cu = driver()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device_index
    return prop


def granularity(device: torch.device) -> int:
    """The driver's mapping granule for device memory on `device` (2 MiB on Hopper)."""
    cu = driver()
    if device.type == "cuda":
        torch.cuda.init()
    return int(check(cu.cuMemGetAllocationGranularity(
        allocation_prop(device.index or 0),
        cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))


class PageHandles:
    """`count` physical handles of `nbytes` each on one device, created at once (the
    pool's memory is reserved up front: nothing is allocated while serving), the address
    ranges reserved for them, and every mapping made: each handle whole, at offset 0.

    Plain bookkeeping over the driver, no knowledge of blocks or slots. `release` unmaps
    what is mapped, frees the ranges and the handles (it holds no reference to its owner,
    so an owner's finalizer can call it)."""

    def __init__(self, count: int, nbytes: int, device_index: int) -> None:
        self.cu = cu = driver()
        self.nbytes = nbytes
        self.handles: list = []
        self.reserved: list[tuple[int, int]] = []
        self.mapped: dict[int, int] = {}
        """Address -> the handle (its index) mapped there."""
        self.calls = 0
        """Map and unmap calls made so far."""
        self._access = cu.CUmemAccessDesc()
        self._access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._access.location.id = device_index
        self._access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        prop = allocation_prop(device_index)
        try:
            for _ in range(count):
                self.handles.append(check(cu.cuMemCreate(nbytes, prop, 0)))
        except RuntimeError as exc:
            self.release()
            raise RuntimeError(f"{exc} creating {count} handles of {nbytes} bytes (made "
                               f"{len(self.handles)})") from exc

    def reserve(self, nbytes: int, alignment: int) -> int:
        """A fresh virtual address range of `nbytes`, nothing mapped in it yet."""
        addr = int(check(self.cu.cuMemAddressReserve(nbytes, alignment, 0, 0)))
        self.reserved.append((addr, nbytes))
        return addr

    def map(self, addr: int, handle: int) -> None:
        """Handle `handle`, whole, at `addr` (unmapped: the driver maps nothing in place),
        readable and writable from the device."""
        cu = self.cu
        ptr = cu.CUdeviceptr(addr)
        check(cu.cuMemMap(ptr, self.nbytes, 0, self.handles[handle], 0))
        self.mapped[addr] = handle
        check(cu.cuMemSetAccess(ptr, self.nbytes, [self._access], 1))
        self.calls += 1

    def unmap(self, addr: int) -> None:
        """The handle mapped at `addr`, if any."""
        if self.mapped.pop(addr, None) is not None:
            check(self.cu.cuMemUnmap(self.cu.CUdeviceptr(addr), self.nbytes))
            self.calls += 1

    def release(self) -> None:
        cu = self.cu
        for addr in list(self.mapped):
            cu.cuMemUnmap(cu.CUdeviceptr(addr), self.nbytes)
        self.mapped.clear()
        for addr, nbytes in self.reserved:
            cu.cuMemAddressFree(cu.CUdeviceptr(addr), nbytes)
        self.reserved.clear()
        for handle in self.handles:
            cu.cuMemRelease(handle)
        self.handles.clear()
