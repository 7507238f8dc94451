"""The virtual KV layout on CUDA: `virtual_kv.py`'s slots and views on the driver's virtual
memory API (`cuda_vmm.py`), vAttention's way: one physical handle per mapped unit, each
mapped at offset 0, and the next step's mappings made while the current step runs.

Memory: a block is cut into `regions` units of whole driver pages (`virtual_pages.py`:
the `block` layout, all layers in one unit; or the `layer` layout, one unit per layer's K
or V), and each unit of each block is its own handle, all created at start (the pool's
memory is reserved up front; serving allocates nothing). Every handle is mapped once into
the linear range (`buffer`: copy-on-write, the disk tier; region r's blocks back to back),
and into a slot's view wherever a block table puts its block: the same physical memory at
several addresses, so a block the tree shares is one copy however many views show it.

What differs from the CPU, and why:
- The driver maps whole pages (2 MiB on Hopper), so units are padded to pages, and the
  views are strided per block (`[num_slots * slot_blocks, page_size, kv_heads, head_dim]`
  per layer, a block every `unit` bytes), which the Triton kernels read as they are.
- The driver can neither map at a non-zero offset into a handle (`cuda_vmm.py`) nor
  replace a mapping in place: a view position is unmapped, then mapped again, one handle
  per region; runs are not merged and no VMA budget applies.
- An unmapped address faults when read. Only the Triton kernels run on these views: they
  read each sequence's own tokens and nothing past them (SDPA, which pads a batch of
  decodes to the longest context, would read unmapped positions).
- Mapping costs the driver tens of microseconds a handle (29 us median, 355 us p99 on an
  H200), so it is kept off the step's path: once a step's kernels are queued,
  `map_ahead` maps on a thread the blocks each sequence's next step most likely adds
  (the allocator extends a growing table with the blocks after its last one), touching
  only positions and blocks the running step does not read. The next step waits only
  for what the thread has not finished, or did not predict (new sequences' tables, a
  block other than the predicted one); `stats` counts those waits and their time.
"""

from __future__ import annotations

import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from radixserve.worker.cuda_vmm import PageHandles, granularity
from radixserve.worker.seq_rows import StepSeqs
from radixserve.worker.virtual_kv import MapStats, VirtualKVPool
from radixserve.worker.virtual_pages import LayoutName, choose


@dataclass
class AheadStats(MapStats):
    """`MapStats`, and the mapping thread's part."""

    mapped_ahead: int = 0
    """Blocks mapped into a view by the thread, before the step that reads them."""
    map_waits: int = 0
    """Times a step waited for mappings: for the thread to finish, or for those made on the
    step's own path (not predicted)."""
    map_wait_seconds: float = 0.0


class CudaVirtualKVPool(VirtualKVPool):
    """`VirtualKVPool` on CUDA virtual memory: the same slots, bookkeeping and views
    (strided per block, see the module docstring), each view position `regions` handles."""

    def __init__(self, num_layers: int, num_blocks: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, num_slots: int, slot_blocks: int,
                 device: torch.device, page_layout: LayoutName = "auto") -> None:
        index = device.index or 0
        if device.type == "cuda":  # (another device type: tests/worker/test_virtual_kv_cuda)
            index = device.index if device.index is not None else torch.cuda.current_device()
            device = torch.device("cuda", index)  # the storages' device names its index
            torch.cuda.set_device(index)
            torch.empty(1, device=device)  # the primary context, current on this thread
        self.device = device
        self.num_blocks, self.page_size = num_blocks, page_size
        self.num_slots, self.slot_blocks = num_slots, slot_blocks
        granule = granularity(device)
        row = num_kv_heads * head_dim
        self.layout = choose(page_layout, num_layers, page_size, row * dtype.itemsize, granule)
        self.regions, self.unit = self.layout.regions, self.layout.unit
        self.pages = PageHandles(self.regions * num_blocks, self.unit, index)
        self._mapper = ThreadPoolExecutor(1, "kv-map-ahead", initializer=_bind,
                                          initargs=(device,))
        weakref.finalize(self, _close, self._mapper, device, self.pages)
        self._ahead: Future | None = None
        self._slots: list[int] = []
        """The slot of each sequence of the last step prepared."""
        linear = self.pages.reserve(self.nbytes, granule)
        for h in range(self.regions * num_blocks):  # region r's block b: r * num_blocks + b
            self.pages.map(linear + h * self.unit, h)
        positions = num_slots * slot_blocks
        self.region_stride = positions * self.unit
        self.base = self.pages.reserve(self.regions * self.region_stride, granule)
        items = self.unit // dtype.itemsize
        plane = page_size * row  # elements of one layer's K (or V) of a block
        # A plane's step: to the next plane of the unit, or (one plane a unit) region.
        step = plane if self.layout.planes > 1 else num_blocks * items
        self.buffer = self._strided(self._storage(linear, self.nbytes), dtype, (
            num_layers, 2, num_blocks, page_size, num_kv_heads, head_dim),
            (2 * step, step, items, row, head_dim, 1))
        self.buffer.zero_()  # padded reads past a sequence's end never meet NaNs
        self.physical = [(self.buffer[i, 0], self.buffer[i, 1]) for i in range(num_layers)]
        # One storage per region, which its planes' views share (the Triton interpreter
        # copies tensors back by storage: two storages over one address would copy the
        # unmapped positions too).
        regions = [self._storage(self.base + r * self.region_stride, self.region_stride)
                   for r in range(self.regions)]

        def view(j: int) -> torch.Tensor:
            r, q = divmod(j, self.layout.planes)
            shape = (positions, page_size, num_kv_heads, head_dim)
            return self._strided(regions[r], dtype, shape, (items, row, head_dim, 1),
                                 offset=q * plane)
        self.layers = [(view(2 * i), view(2 * i + 1)) for i in range(num_layers)]
        self.stats: AheadStats = AheadStats()
        self._init_slots()

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.layout.block_bytes

    def _storage(self, addr: int, nbytes: int) -> torch.types.Storage:
        """Device memory at `addr` as a storage (the pool's: the storage does not own it)."""
        return torch._C._construct_storage_from_data_pointer(addr, self.device, nbytes)

    def _strided(self, storage: torch.types.Storage, dtype: torch.dtype,
                 shape: tuple[int, ...], strides: tuple[int, ...], offset: int = 0
                 ) -> torch.Tensor:
        return torch.empty(0, dtype=dtype, device=self.device).set_(storage, offset, shape,
                                                                     strides)

    # -- the step's path ---------------------------------------------------------------
    def prepare(self, block_tables: list[list[int]], kv_lens: list[int], q_lens: list[int],
                copied: list[int]) -> list[int]:
        """`VirtualKVPool.prepare`, once the mapping thread is done and no work in flight
        reads the views it remaps (the last step ended with a sync already, so this waits
        for little but the step's copy-on-write, which does not read them). What it maps
        itself was not mapped ahead: a wait, counted."""
        self._wait_counted()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start, calls = time.perf_counter(), self.pages.calls
        self._slots = super().prepare(block_tables, kv_lens, q_lens, copied)
        if self.pages.calls > calls:
            self.stats.map_waits += 1
            self.stats.map_wait_seconds += time.perf_counter() - start
        return self._slots

    def map_ahead(self, step: StepSeqs) -> None:
        """Once the step (prepared last) is queued: map, on the mapping thread, the
        blocks each of its sequences' next step most likely adds into its slot (a decode's
        next token, a prefill chunk's next chunk of the same length: the blocks after its
        table's last, as the allocator hands them out), and drop other views of them. Only
        positions past each table and blocks this step does not read are touched."""
        self._settle()  # (done already: `prepare` waited for it)
        in_step = {b for table in step.context_tables for b in table}
        runs = []
        for s, table, kv, q, sample in zip(self._slots, step.context_tables, step.kv_lens,
                                           step.q_lens, step.sample):
            need = min(-(-(kv + (1 if sample is not None else q)) // self.page_size),
                       self.slot_blocks)
            blocks = list(range(table[-1] + 1, min(table[-1] + 1 + need - len(table),
                                                   self.num_blocks)))
            at = len(table)
            if blocks and in_step.isdisjoint(blocks) and \
                    self.mapped[s][at:at + len(blocks)] != blocks:
                runs.append((s, at, blocks))
        if runs:
            self._ahead = self._mapper.submit(self._map_runs_ahead, runs)

    def _map_runs_ahead(self, runs: list[tuple[int, int, list[int]]]) -> None:
        """(On the mapping thread.) Each run `(slot, position, blocks)` mapped, and every
        other view of its blocks dropped (their next writer is this slot)."""
        for s, p, blocks in runs:
            self._map_run(s, p, blocks)
            for q, b in enumerate(blocks, p):
                for other in [m for m in self.where[b] if m != (s, q)]:
                    self._unmap(*other, 1)
            self.stats.mapped_ahead += len(blocks)

    def _settle(self) -> float:
        """Wait for the mapping thread's job (its error, if any, raised here): the seconds
        waited, 0 where it had finished."""
        job, self._ahead = self._ahead, None
        if job is None:
            return 0.0
        start, finished = time.perf_counter(), job.done()
        job.result()
        return 0.0 if finished else time.perf_counter() - start

    def _wait_counted(self) -> None:
        """`_settle` on the step's path: a wait for the thread is counted."""
        if waited := self._settle():
            self.stats.map_waits += 1
            self.stats.map_wait_seconds += waited

    def write_blocks(self, blocks: list[int], kv: torch.Tensor) -> None:
        self._wait_counted()
        super().write_blocks(blocks, kv)

    def release_all(self) -> None:
        self._settle()
        super().release_all()

    # -- the driver --------------------------------------------------------------------
    def _view(self, region: int, position: int) -> int:
        return self.base + region * self.region_stride + position * self.unit

    def _map_range(self, position: int, block: int, n: int) -> None:
        calls = self.pages.calls
        for i in range(n):
            for r in range(self.regions):
                addr = self._view(r, position + i)
                self.pages.unmap(addr)
                self.pages.map(addr, r * self.num_blocks + block + i)
        self.stats.mmap_calls += self.pages.calls - calls

    def _unmap_range(self, position: int, n: int) -> None:
        calls = self.pages.calls
        for p in range(position, position + n):
            for r in range(self.regions):
                self.pages.unmap(self._view(r, p))
        self.stats.mmap_calls += self.pages.calls - calls

    def mapping_count(self) -> int:
        """View positions mapped now (each `regions` handles), plus the linear range as
        one: 1 when the views map nothing."""
        self._settle()
        return (len(self.pages.mapped) - self.regions * self.num_blocks) // self.regions + 1

    def mapped_blocks(self, s: int) -> list[int]:
        self._settle()
        return super().mapped_blocks(s)


def _bind(device: torch.device) -> None:
    """The mapping thread's CUDA context: the device's primary one."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _close(mapper: ThreadPoolExecutor, device: torch.device, pages: PageHandles) -> None:
    """At the pool's collection, or at exit: the thread's last job done, the device idle,
    every mapping, range and handle released."""
    mapper.shutdown(wait=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    pages.release()
