"""The virtual KV layout (vAttention) on the CPU: contiguous per-slot views over a memfd pool.

The physical pool is one memfd in the paged pool's own layout, `[num_layers, 2,
num_blocks, page_size, num_kv_heads, head_dim]`: each layer's K (and V) is a *plane* of
blocks back to back. The views copy it: per plane, a region of `num_slots * slot_blocks`
block positions, so that a sequence's keys in one layer are one contiguous stretch, which
the decode read's hardware prefetch needs to keep pace with the paged pool. (Measured
with the native decode at batch 8-64 and 2k context: views whose layer rows jumped a whole
block, 720 KiB, every 16 tokens read at 0.84-0.90x the paged pool's speed; a layer's K and
V together, 0.94x; this layout, 0.98-1.01x.)

The price is in mappings: a run of consecutive blocks is mapped once per region
(`regions` = 2 x num_layers mmaps and VMAs, 60 for the default model), so the VMA budget
counts *view mappings* of `regions` VMAs each (`vma_budget.py`). Where a block's rows in
one plane are not whole memory pages (bf16 at page size 16, tiny test models), the pool
falls back to one region with a block's planes together (`[num_blocks, num_layers, 2,
...]`: one VMA a run, the slower read); `VirtualKVPool.regions` says which.

Each slot (one per possible running sequence) owns `slot_blocks` positions of every
region. A block is mapped into a slot with `MAP_FIXED | MAP_SHARED` at its position in the
sequence's block table; blocks the radix tree shares are mapped into every slot that uses
them, without a copy. The unmapped rest of a region is anonymous read-only memory (the
kernel's shared zero page, nothing committed), not `PROT_NONE`: a gathered batch of
decodes (the fallback where the native kernel does not run) pads each table with its
first block, and no read may fault. A stray write into it still faults. Regions are
separated by one `PROT_NONE` page, so that their zero stretches never merge and every
region holds the same VMAs.

Which slot holds which sequence is derived here from the step's block tables alone (the
worker keeps no requests): a sequence that ran last step finds the slot that maps its last
cached block at that position; a new one takes the free slot whose mapped prefix is the
longest common one with its table (deferred reclamation: a finished sequence's mappings
stay until the slot is reused, and only the difference is remapped). Stale mappings are
harmless to reads, since a mapping always shows the block's current contents, but a block
written this step (a fresh block, a copy-on-write target, one loaded from the disk tier)
loses every mapping other than its writer's first, so no slot keeps an old view of a
reused block. All mapping is done in `prepare`, before the step's first layer. Pages are
not prefaulted (`MAP_POPULATE`): the first read through a new view fills its page tables,
which `bench/results/virtual_kv_full.md` measured cheaper than populating at `mmap` time.

The VMA budget (`vma_budget.py`): every mapping is a kernel VMA (`vm.max_map_count`).
The layout keeps its exact count as it maps (`vmas`: one region's, by the kernel's merge
rule; the kernel's is `regions * vmas + regions - 1` with the guard pages) and,
when a step's mappings would take it past the budget, unmaps stale views first (free
slots', least recently used first, then what lies past a running sequence's table):
admission keeps the running sequences' own views within the budget, so that is enough.
"""

from __future__ import annotations

import ctypes
import math
import os
import weakref
from dataclasses import dataclass

import torch

from radixserve.worker.cascade import CascadePlan, SharedRun
from radixserve.worker.kv_pool import KVPool, StepTables
from radixserve.worker.mmap_calls import map_file, map_guard, map_zeros, munmap
from radixserve.worker.seq_rows import StepSeqs
from radixserve.worker.staging import to_device
from radixserve.worker.vma_budget import MappingBudget, vma_starts

PAGE = os.sysconf("SC_PAGE_SIZE")


def plane_regions(page_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype) -> int:
    """The regions a pool of this geometry is mapped in: one per plane (2 x num_layers)
    where a block's rows in one plane are whole memory pages, else one, where a whole
    block must be (ValueError naming the smallest page_size that is)."""
    per_plane = page_size * num_kv_heads * head_dim * dtype.itemsize
    if per_plane % PAGE == 0:
        return 2 * num_layers
    nbytes = 2 * num_layers * per_plane
    if nbytes % PAGE:
        per_token = nbytes // page_size
        smallest = PAGE // math.gcd(PAGE, per_token)
        raise ValueError(
            f"kv_layout='virtual' maps whole KV blocks, which must be multiples of the "
            f"{PAGE}-byte memory page: a block of page_size={page_size} holds {nbytes} bytes "
            f"({per_token} per token, all layers); use a page_size that is a multiple of "
            f"{smallest}")
    return 1


@dataclass
class MapStats:
    """What the layout did so far (for stats, tests and the bench)."""

    mmap_calls: int = 0
    blocks_mapped: int = 0
    blocks_unmapped: int = 0
    slots_reused: int = 0
    """Sequences that took a free slot already mapping part of their table."""


class VirtualKVPool(KVPool):
    """The memfd pool, its linear (physical) view, and the slots' contiguous views.

    `buffer`: the pool in `KVPool`'s shape (strided in the one-region layout), so that
    what works on blocks there (copy-on-write, the disk tier's reads and writes) works
    here. `physical`: per layer, K and V over the blocks, `[num_blocks, page_size,
    num_kv_heads, head_dim]`. `layers`: per layer, K and V over the slots' views seen as
    blocks back to back, `[num_slots * slot_blocks, page_size, num_kv_heads, head_dim]`,
    where a step's block ids (`view_tables`) are consecutive per sequence: what the
    model's attention reads and writes.
    """

    contiguous = True
    budget: MappingBudget | None = None
    """The VMA budget the views keep (None: mappings that are not kernel VMAs)."""

    def __init__(self, num_layers: int, num_blocks: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, num_slots: int, slot_blocks: int,
                 map_limit: int | None = None) -> None:
        # KVPool's interface over memfd memory: its own __init__ would allocate a tensor.
        self.num_blocks, self.page_size = num_blocks, page_size
        self.num_slots, self.slot_blocks = num_slots, slot_blocks
        self.regions = plane_regions(page_size, num_layers, num_kv_heads, head_dim, dtype)
        self.budget = MappingBudget.plan(num_slots, slot_blocks, page_size, map_limit,
                                         self.regions)
        planes = 2 * num_layers // self.regions  # per region
        rows = (page_size, num_kv_heads, head_dim)
        self.unit = planes * page_size * num_kv_heads * head_dim * dtype.itemsize
        """Bytes of one block in one region (what one position of a view maps)."""
        pool_bytes = self.regions * num_blocks * self.unit
        self.fd = os.memfd_create("radixserve-kv", os.MFD_CLOEXEC)
        weakref.finalize(self, os.close, self.fd)
        os.ftruncate(self.fd, pool_bytes)  # sparse: zeros until written
        pool = self._tensor(map_file(None, pool_bytes, self.fd, 0), pool_bytes, dtype)
        self.buffer = (pool.view(self.regions, num_blocks, planes, *rows)
                       .permute(0, 2, 1, 3, 4, 5).view(num_layers, 2, num_blocks, *rows))
        # The views: one region of slot positions per region of the pool, a guard page
        # after each but the last.
        positions = num_slots * slot_blocks
        self.region_stride = positions * self.unit + PAGE
        self.reserved = self.regions * self.region_stride - PAGE
        self.base = map_zeros(None, self.reserved)
        for r in range(1, self.regions):
            map_guard(self.base + r * self.region_stride - PAGE, PAGE)
        views = self._tensor(self.base, self.reserved, dtype).as_strided(
            (self.regions, positions, planes, *rows),
            (self.region_stride // dtype.itemsize, self.unit // dtype.itemsize,
             math.prod(rows), rows[1] * rows[2], rows[2], 1))
        plane = [views[j // planes, :, j % planes] for j in range(2 * num_layers)]
        self.physical = [(self.buffer[i, 0], self.buffer[i, 1]) for i in range(num_layers)]
        self.layers = [(plane[2 * i], plane[2 * i + 1]) for i in range(num_layers)]
        self.stats = MapStats()
        self._init_slots()

    def _init_slots(self) -> None:
        """The bookkeeping of what each slot maps (nothing yet)."""
        self.mapped = [[-1] * self.slot_blocks for _ in range(self.num_slots)]
        """Per slot and position: the block mapped there, or -1."""
        self.where: dict[int, set[tuple[int, int]]] = {}
        """Per block: the (slot, position) pairs that map it."""
        self.last_kv = [0] * self.num_slots
        """Per slot: its sequence's tokens after the last step that used it (0: free)."""
        self.used_at = [0] * self.num_slots
        """Per slot: the last step that used it (`steps` then)."""
        self.steps = 0
        self.vmas = 1
        """The VMAs the views hold (the reservation is one zero stretch to begin with)."""

    @staticmethod
    def _tensor(addr: int, size: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat tensor over `size` mapped bytes at `addr`, which are unmapped when the
        last tensor over them goes (the ctypes array is the buffer the tensors keep
        alive; frombuffer reads none of it, so guard pages are fine)."""
        raw = (ctypes.c_char * size).from_address(addr)
        weakref.finalize(raw, munmap, addr, size)
        return torch.frombuffer(raw, dtype=dtype)

    def write_blocks(self, blocks: list[int], kv: torch.Tensor) -> None:
        """`KVPool.write_blocks` (the disk tier's loads), and no view keeps these blocks:
        they hold other tokens now."""
        super().write_blocks(blocks, kv)
        for b in blocks:
            for s, p in list(self.where.get(b, ())):
                self._unmap(s, p, 1)

    # -- slots ------------------------------------------------------------------------
    def step_tables(self, step: StepSeqs, cascade: CascadePlan | None) -> StepTables:
        """Map the step's block tables into slots (`prepare`), and name its blocks and KV
        slots in the views (the plan is made on the pool's ids: equal ids, shared KV)."""
        slots = self.prepare(step.context_tables, step.kv_lens, step.q_lens,
                             [dst for _, dst in step.batch.block_copies])
        return StepTables(
            self.view_tables(slots, step.width),
            self.view_index(slots, step.q_lens_t, step.positions),
            None if cascade is None else self.view_plan(cascade, slots))

    def map_ahead(self, step: StepSeqs) -> None:
        """Once `step`'s kernels are queued: nothing on the CPU, whose views are mapped in
        `step_tables` (the CUDA layout maps the next step's on a thread meanwhile)."""

    def prepare(self, block_tables: list[list[int]], kv_lens: list[int], q_lens: list[int],
                copied: list[int]) -> list[int]:
        """Give each sequence of the step a slot whose view maps its block table, mapping
        only what differs, and drop other views of the blocks written this step (`copied`:
        the copy-on-write targets). Returns the slot of each sequence."""
        if len(block_tables) > self.num_slots:
            raise ValueError(f"{len(block_tables)} sequences in a step, but the virtual "
                             f"layout has {self.num_slots} slots (max_running_requests)")
        slots = self._assign(block_tables, kv_lens, q_lens)
        runs = []
        for s, table in zip(slots, block_tables):
            if len(table) > self.slot_blocks:
                raise ValueError(f"a block table of {len(table)} blocks exceeds a slot's "
                                 f"{self.slot_blocks} (context_length)")
            runs += [(s, p, blocks) for p, blocks in self._runs_to_map(s, table)]
        keep = self._writers(slots, block_tables, kv_lens, q_lens, copied)
        # Mapping a run, or dropping a stale view of a block written now, splits at most
        # one VMA in three.
        growth = 2 * (len(runs) + sum(len(self.where.get(b, ())) for b in keep))
        if self.budget is not None and self.vmas + growth > self.budget.views_budget:
            self._reclaim(dict(zip(slots, map(len, block_tables))), growth)
        for s, p, blocks in runs:
            self._map_run(s, p, blocks)
        self.steps += 1
        for s, kv in zip(slots, kv_lens):
            self.used_at[s], self.last_kv[s] = self.steps, kv
        for b, own in keep.items():
            for s, p in [m for m in self.where.get(b, ()) if m != own]:
                self._unmap(s, p, 1)
        return slots

    def _writers(self, slots: list[int], block_tables: list[list[int]], kv_lens: list[int],
                 q_lens: list[int], copied: list[int]) -> dict[int, tuple[int, int]]:
        """The blocks the step writes (its new tokens', and the copy-on-write targets,
        written before the step's stores), each with the (slot, position) writing it."""
        page = self.page_size
        keep: dict[int, tuple[int, int]] = {}
        for s, table, kv, q in zip(slots, block_tables, kv_lens, q_lens):
            for p in range((kv - q) // page, -(-kv // page)):
                keep[table[p]] = (s, p)
        if copied:
            targets = set(copied)
            for s, table in zip(slots, block_tables):
                for p, b in enumerate(table):
                    if b in targets:
                        keep[b] = (s, p)
        return keep

    def view_index(self, slots: list[int], q_lens: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
        """`[T]` int64 on the positions' device: each new token's KV slot in the views, flat
        (slot * slot tokens + position), as `slot_mapping` indexes the paged pool."""
        first = to_device(slots, positions.device)
        per_token = torch.repeat_interleave(first, q_lens.long(), output_size=len(positions))
        return per_token * (self.slot_blocks * self.page_size) + positions

    def view_tables(self, slots: list[int], width: int) -> torch.Tensor:
        """`[B, width]` int32 block tables over the views seen as blocks back to back
        (`[num_slots * slot_blocks, page_size, ...]`): sequence i's blocks are consecutive
        from `slots[i] * slot_blocks`."""
        first = torch.tensor(slots, dtype=torch.int32)[:, None] * self.slot_blocks
        return first + torch.arange(width, dtype=torch.int32)[None, :]

    def view_plan(self, plan: CascadePlan, slots: list[int]) -> CascadePlan:
        """`plan` with each shared run's blocks named in the views of its first member
        (they are mapped there, as in every member's): consecutive ids, as `view_tables`."""
        def view_run(run: SharedRun) -> SharedRun:
            first = slots[run.seqs[0]] * self.slot_blocks + run.block_start
            return SharedRun(run.seqs, run.block_start,
                             list(range(first, first + len(run.blocks))))
        return CascadePlan([[view_run(run) for run in level] for level in plan.levels],
                           plan.own_start)

    def _assign(self, tables: list[list[int]], kv_lens: list[int], q_lens: list[int]) -> list[int]:
        page, where, mapped = self.page_size, self.where, self.mapped
        slots = [-1] * len(tables)
        taken: set[int] = set()
        # Sequences that ran before: the slot mapping their last cached block there (the
        # one whose sequence had exactly that many tokens, if several share the block).
        for i, (table, kv, q) in enumerate(zip(tables, kv_lens, q_lens)):
            cached = kv - q
            if cached == 0:
                continue
            p = (cached - 1) // page
            cands = [s for s, pos in where.get(table[p], ()) if pos == p and s not in taken]
            if cands:
                s = max(cands, key=lambda c: (self.last_kv[c] == cached, -c))
                slots[i] = s
                taken.add(s)
        # The others: a slot mapping the longest common prefix of their table, else the
        # lowest free one (slots nothing ran in last step count as free).
        free = [s for s in range(self.num_slots) if s not in taken]
        for i, table in enumerate(tables):
            if slots[i] >= 0:
                continue
            best, best_len = -1, 0
            for s, pos in where.get(table[0], ()):
                if pos == 0 and s not in taken:
                    m, n = mapped[s], 0
                    while n < len(table) and m[n] == table[n]:
                        n += 1
                    if n > best_len or (n == best_len and s < best):
                        best, best_len = s, n
            if best < 0:
                best = next(s for s in free if s not in taken)
            else:
                self.stats.slots_reused += 1
            slots[i] = best
            taken.add(best)
        return slots

    def _runs_to_map(self, s: int, table: list[int]) -> list[tuple[int, list[int]]]:
        """Where slot `s` must map what it does not yet to show `table`: (position, run of
        consecutive block ids) pairs."""
        m, n = self.mapped[s], len(table)
        if m[:n] == table:
            return []
        runs, p = [], 0
        while p < n:
            if m[p] == table[p]:
                p += 1
                continue
            end = p + 1  # a run: consecutive positions holding consecutive blocks
            while end < n and m[end] != table[end] and table[end] == table[end - 1] + 1:
                end += 1
            runs.append((p, table[p:end]))
            p = end
        return runs

    def _reclaim(self, active: dict[int, int], growth: int) -> None:
        """Unmap stale views until `growth` more VMAs fit the budget, or none is left:
        whole free slots, least recently used first, then what lies past the tables of
        the step's slots (`active`: slot -> table length)."""
        assert self.budget is not None
        free = sorted((s for s in range(self.num_slots) if s not in active),
                      key=self.used_at.__getitem__)
        for s, start in [(s, 0) for s in free] + list(active.items()):
            if self.vmas + growth <= self.budget.views_budget:
                return
            if any(b >= 0 for b in self.mapped[s][start:]):
                self._unmap(s, start, self.slot_blocks - start)

    def _vma_starts(self, lo: int, hi: int) -> int:
        return vma_starts(self.mapped, lo, min(hi, self.num_slots * self.slot_blocks))

    def _map_run(self, s: int, p: int, blocks: list[int]) -> None:
        lo = s * self.slot_blocks + p
        before = self._vma_starts(lo, lo + len(blocks) + 1)
        for q, b in enumerate(blocks, p):
            old = self.mapped[s][q]
            if old >= 0:
                self.where[old].discard((s, q))
            self.mapped[s][q] = b
            self.where.setdefault(b, set()).add((s, q))
        self.vmas += self._vma_starts(lo, lo + len(blocks) + 1) - before
        self._map_range(lo, blocks[0], len(blocks))
        self.stats.blocks_mapped += len(blocks)

    def _map_range(self, position: int, block: int, n: int) -> None:
        """Map blocks `block .. block+n-1` at view positions `position ..` (counted over
        all slots), in place of what is there: one `mmap` per region."""
        for r in range(self.regions):
            map_file(self.base + r * self.region_stride + position * self.unit,
                     n * self.unit, self.fd, (r * self.num_blocks + block) * self.unit)
        self.stats.mmap_calls += self.regions

    def _unmap_range(self, position: int, n: int) -> None:
        """Back to the zero reserve: view positions `position .. position+n-1`, every region."""
        for r in range(self.regions):
            map_zeros(self.base + r * self.region_stride + position * self.unit, n * self.unit)
        self.stats.mmap_calls += self.regions

    def _unmap(self, s: int, p: int, n: int) -> None:
        """Back to the zero reserve: positions `p .. p+n-1` of slot `s`."""
        lo = s * self.slot_blocks + p
        before = self._vma_starts(lo, lo + n + 1)
        for q in range(p, p + n):
            b = self.mapped[s][q]
            if b >= 0:
                self.where[b].discard((s, q))
                self.mapped[s][q] = -1
                self.stats.blocks_unmapped += 1
        self.vmas += self._vma_starts(lo, lo + n + 1) - before
        self._unmap_range(lo, n)

    def release_all(self) -> None:
        """Unmap every slot in one call: after a cache flush nothing they map is worth keeping."""
        self._unmap_range(0, self.num_slots * self.slot_blocks)
        self.stats.blocks_unmapped += sum(b >= 0 for m in self.mapped for b in m)
        self._init_slots()

    def mappings(self) -> tuple[int, int]:
        return (0, 0) if self.budget is None else (self.vmas, self.budget.views_budget)

    def mapping_count(self) -> int:
        """The VMAs the slots hold now, recounted from what each position maps (`vmas`
        is kept as it goes)."""
        return self._vma_starts(0, self.num_slots * self.slot_blocks)

    def mapped_blocks(self, s: int) -> list[int]:
        return [b for b in self.mapped[s] if b >= 0]
