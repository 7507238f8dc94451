"""The virtual KV layout on CUDA: `virtual_kv.py`'s slots and views on the driver's virtual
memory API (`cuMemCreate`, `cuMemAddressReserve`, `cuMemMap`, `cuMemSetAccess`, through
the `cuda-bindings` package: `pip install 'radixserve[cuda]'`).

What differs from the CPU, and why:
- The driver maps whole allocation-granularity pages (2 MiB on Hopper), not 4 KiB ones.
  A block (its tokens' K and V of every layer, token-major:
  `[page_size, layers, 2, kv_heads, head_dim]`; the CPU's keeps each layer's rows together) is padded up to
  a whole number of them: the *block stride*. For a large model a 16-token block already
  fills 2 MiB (Llama-3-8B in bf16: 128 KiB a token); for a small one the page size must
  grow until a block fills its pages (the default model in bf16 holds 23,040 bytes a
  token: 91 tokens fill 2 MiB), so prefixes are shared at that coarser grain. A page size
  whose padding would waste more than 1/8 of each block is refused, naming the smallest
  one that fits (`block_stride`). The views are therefore strided per block, shaped
  `[num_slots * slot_blocks, page_size, num_kv_heads, head_dim]` per layer (the ids the
  worker's metadata gives them), not per slot.
- CUDA can neither replace a mapping in place nor unmap part of one: every view position
  is its own `cuMemMap` (unmapped first when it held another block), so the merging of
  runs the CPU does for its VMA budget has no counterpart, and no VMA budget applies.
- An unmapped address faults when read. Only the Triton kernels run on these views: they
  read each sequence's own tokens and nothing past them (SDPA, which pads a batch of
  decodes to the longest context, would read unmapped positions).

Physical memory is one allocation of `num_blocks` block strides, mapped once, linearly,
for the pool's own view (`blocks`, `buffer`: copy-on-write, the disk tier); the slots'
views map the same allocation at other addresses, so a block shared by the tree is one
copy in memory however many views show it.
"""

from __future__ import annotations

import weakref

import torch

from radixserve.worker.kv_pool import KVPool
from radixserve.worker.virtual_kv import MapStats, VirtualKVPool

MAX_PADDING = 1 / 8
"""The largest share of a block stride its padding may take."""


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise ValueError("kv_layout='virtual' on CUDA needs the cuda-bindings package "
                         "(pip install 'radixserve[cuda]')") from exc
    return driver


def _check(result):
    """The value(s) of a `cuda.bindings.driver` call, or RuntimeError naming its error."""
    cu = _driver()
    err, *values = result
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise RuntimeError(f"CUDA driver: {name.decode() if name else err}")
    return values[0] if len(values) == 1 else values


def granularity(device: torch.device) -> int:
    """The driver's mapping granule for device memory on `device` (2 MiB on Hopper)."""
    cu = _driver()
    if device.type == "cuda":
        torch.cuda.init()
    return int(_check(cu.cuMemGetAllocationGranularity(
        _allocation_prop(device.index or 0),
        cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))


def block_stride(page_size: int, token_bytes: int, granule: int) -> int:
    """A block's bytes padded to whole granules; ValueError naming the page size that
    pads least when this one's padding exceeds `MAX_PADDING` of it."""
    def stride(p: int) -> int:
        return -(-p * token_bytes // granule) * granule

    def padding(p: int) -> float:
        return 1 - p * token_bytes / stride(p)

    if padding(page_size) <= MAX_PADDING:
        return stride(page_size)
    best = min(range(1, 1025), key=lambda p: (padding(p), p))
    raise ValueError(
        f"kv_layout='virtual' on CUDA maps whole {granule}-byte pages: a block of "
        f"page_size={page_size} holds {page_size * token_bytes} bytes ({token_bytes} per "
        f"token, all layers), {padding(page_size):.0%} of its {stride(page_size)} would be "
        f"padding; use a page_size whose blocks fill their pages, such as {best} "
        f"({padding(best):.1%} padding)")


def _allocation_prop(device_index: int):
    cu = _driver()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device_index
    return prop


class CudaVirtualKVPool(VirtualKVPool):
    """`VirtualKVPool` on CUDA virtual memory: the same slots, bookkeeping and views
    (per block, see the module docstring), each view position mapped on its own."""

    def __init__(self, num_layers: int, num_blocks: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, num_slots: int, slot_blocks: int,
                 device: torch.device) -> None:
        cu = _driver()
        index = device.index or 0
        if device.type == "cuda":  # (another device type: tests/worker/test_virtual_kv_cuda)
            index = device.index if device.index is not None else torch.cuda.current_device()
            device = torch.device("cuda", index)  # the storages' device names its index
            torch.cuda.set_device(index)
            torch.empty(1, device=device)  # the primary context, current on this thread
        self.device = device
        self.num_blocks, self.page_size = num_blocks, page_size
        self.num_slots, self.slot_blocks = num_slots, slot_blocks
        self.block_bytes = KVPool.bytes_per_block(num_layers, page_size, num_kv_heads, head_dim,
                                                 dtype)
        granule = granularity(device)
        self.block_stride = block_stride(page_size, self.block_bytes // page_size, granule)
        self.mappings_budget = 0  # no kernel VMAs here
        self._access = cu.CUmemAccessDesc()
        self._access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._access.location.id = index
        self._access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        pool_bytes = num_blocks * self.block_stride
        self._handle = _check(cu.cuMemCreate(pool_bytes, _allocation_prop(index), 0))
        linear = self._reserve(pool_bytes, granule)
        self._map(linear, pool_bytes, 0)
        views_bytes = num_slots * slot_blocks * self.block_stride
        self.base = self._reserve(views_bytes, granule)
        self._live: set[int] = set()
        """View positions (over all slots) that hold a mapping now."""
        self._finalizer = weakref.finalize(self, _release, cu, device, self._handle, linear,
                                           pool_bytes, self.base, views_bytes,
                                           self.block_stride, self._live)
        token = (num_layers, 2, num_kv_heads, head_dim)
        self.blocks = self._tensor(linear, pool_bytes, dtype, num_blocks, token)
        self.buffer = self.blocks.permute(2, 3, 0, 1, 4, 5)
        self.physical = [(self.buffer[i, 0], self.buffer[i, 1]) for i in range(num_layers)]
        self.blocks.zero_()  # padded reads past a sequence's end never meet NaNs
        views = self._tensor(self.base, views_bytes, dtype, num_slots * slot_blocks, token)
        self.layers = [(views[:, :, i, 0], views[:, :, i, 1]) for i in range(num_layers)]
        self.stats = MapStats()
        self._init_slots()

    def prepare(self, block_tables: list[list[int]], kv_lens: list[int], q_lens: list[int],
                copied: list[int]) -> list[int]:
        """`VirtualKVPool.prepare`, once no work in flight reads the views it remaps (the
        last step ended with a sync already, so this waits for little but the step's
        copy-on-write, which does not read them)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return super().prepare(block_tables, kv_lens, q_lens, copied)

    @staticmethod
    def _reserve(nbytes: int, granule: int) -> int:
        return int(_check(_driver().cuMemAddressReserve(nbytes, granule, 0, 0)))

    def _map(self, addr: int, nbytes: int, offset: int) -> None:
        cu = _driver()
        ptr = cu.CUdeviceptr(addr)
        _check(cu.cuMemMap(ptr, nbytes, offset, self._handle, 0))
        _check(cu.cuMemSetAccess(ptr, nbytes, [self._access], 1))

    def _tensor(self, addr: int, nbytes: int, dtype: torch.dtype, num_blocks: int,
                token: tuple[int, ...]) -> torch.Tensor:
        """`[num_blocks, page_size, *token]` over device memory at `addr`, a block every
        `block_stride` bytes (the memory is this pool's: the tensor does not own it)."""
        storage = torch._C._construct_storage_from_data_pointer(addr, self.device, nbytes)
        per_token = torch.Size(token).numel()
        shape = (num_blocks, self.page_size, *token)
        strides = [self.block_stride // dtype.itemsize, per_token]
        for n in token:
            strides.append(strides[-1] // n)
        return torch.empty(0, dtype=dtype, device=self.device).set_(storage, 0, shape, strides)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_stride

    def _map_range(self, position: int, block: int, n: int) -> None:
        cu = _driver()
        for i in range(n):
            addr = self.base + (position + i) * self.block_stride
            if position + i in self._live:
                _check(cu.cuMemUnmap(cu.CUdeviceptr(addr), self.block_stride))
            self._map(addr, self.block_stride, (block + i) * self.block_stride)
            self._live.add(position + i)
            self.stats.mmap_calls += 1

    def _unmap_range(self, position: int, n: int) -> None:
        cu = _driver()
        for p in [p for p in range(position, position + n) if p in self._live]:
            _check(cu.cuMemUnmap(cu.CUdeviceptr(self.base + p * self.block_stride),
                                 self.block_stride))
            self._live.discard(p)
            self.stats.mmap_calls += 1

    def mapping_count(self) -> int:
        """Mappings the views hold (one per mapped position here), plus the pool's own."""
        return len(self._live) + 1


def _release(cu, device: torch.device, handle, linear: int, pool_bytes: int, base: int,
             views_bytes: int, stride: int, live: set[int]) -> None:
    """Unmap and free everything the pool holds (at its collection, or at exit), through
    the driver module `cu` it was made with."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for p in live:
        cu.cuMemUnmap(cu.CUdeviceptr(base + p * stride), stride)
    cu.cuMemAddressFree(cu.CUdeviceptr(base), views_bytes)
    cu.cuMemUnmap(cu.CUdeviceptr(linear), pool_bytes)
    cu.cuMemAddressFree(cu.CUdeviceptr(linear), pool_bytes)
    cu.cuMemRelease(handle)
