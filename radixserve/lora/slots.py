"""The worker's adapters: those loaded (host memory, by name), the device slots a step's
adapters run from, and each adapted projection's part of a step.

Every adapted projection (`Linear.lora`) holds `max_loras_per_batch` slots of its adapters'
weights, zero-padded to `max_lora_rank` per fused part:
- `a[slot]`: `[parts x rank, in]`, the parts' lora_A stacked;
- `bt[slot]`: `[parts x rank, out]`, their lora_B transposed and scaled, each part's rows
  reaching only that part's outputs (zeros elsewhere),
so a token of adapter `slot` adds `(x a[slot]^T) bt[slot]` to the projection's output, for
every fused part at once, without merging anything into the base weights (S-LoRA/Punica).
A step's tokens of several adapters run together:
- on a GPU, through the Triton kernels (`kernels/lora.py`: each token reads its own slot);
- in fp32 on a CPU, through `native/lora.cpp`: each token reads its adapter's rows alone,
  each part's only to its own rank;
- elsewhere (other dtypes, no compiler), as two matmuls over the slots the step uses, each
  token's shrink kept for its own slot by a 0/1 mask: no gather, no loop over adapters.
Under tensor parallelism the adapter is cut as the projection it adapts: B's rows with a
column-parallel one, A's columns with a row-parallel one, whose partial sums the layer's
all-reduce adds up with the base's.

Which adapter fills which slot is the scheduler's choice (`scheduler/loras.py`), sent with
the step (`ForwardBatch.lora_fills`), as is each sequence's slot (`lora_slots`).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import torch

import radixserve.native as native
from radixserve.config import EngineConfig
from radixserve.config_checks import LORA_TARGETS as TARGETS
from radixserve.config_checks import parse_lora_paths
from radixserve.lora.adapter import LoraAdapter, load_adapter
from radixserve.messages import ForwardBatch, LoraInfo
from radixserve.model.config import ModelConfig
from radixserve.model.linear import Linear, can_pack
from radixserve.model.llama import FUSED, DecoderModel


DEFAULT_RANK = 16
"""`max_lora_rank` when neither it nor `lora_paths` sets it."""


class LoraStep:
    """The current step's adapters, shared by every adapted projection."""

    def __init__(self) -> None:
        self.token_slots: torch.Tensor | None = None
        """Each token's slot (-1: the base model); None: no adapter this step."""
        self.mask: torch.Tensor | None = None
        """`[T, used]`: 1 where a token is of that slot (the CPU path)."""
        self.used = 0
        """Slots `0 .. used - 1` cover every adapter of the step."""
        self.kernels: Any = None
        """`kernels/lora.py`, on a GPU."""
        self.native = False
        """`native/lora.cpp`: fp32 on a CPU that builds it (else the masked matmuls)."""


class LoraProjection:
    """One `Linear`'s adapter slots, and the add of a step's adapters to its output."""

    def __init__(self, linear: Linear, parts: tuple[str, ...], slots: int, rank: int,
                 step: LoraStep) -> None:
        self.linear, self.parts, self.rank, self.step = linear, parts, rank, step
        dtype, device = linear.weight.dtype, linear.weight.device
        width = len(parts) * rank
        self.a = torch.zeros(slots, width, linear.in_local, dtype=dtype, device=device)
        self.bt = torch.zeros(slots, width, sum(linear.parts), dtype=dtype, device=device)
        self.ranks = torch.zeros(slots, len(parts), dtype=torch.long)
        """Each slot's adapter's rank per part (0: it adapts none): the native kernel's."""
        self.part_cols = torch.tensor([0, *itertools.accumulate(linear.parts)])

    def fill(self, slot: int, adapter: LoraAdapter | None, layer: int) -> None:
        """Slot `slot` holds `adapter`'s weights for this projection (zeros: it adapts none
        of its parts, or None)."""
        self.a[slot].zero_()
        self.bt[slot].zero_()
        self.ranks[slot] = 0
        for p, proj in enumerate(self.parts):
            ab = None if adapter is None else adapter.modules.get((layer, proj))
            if ab is None:
                continue
            a, b = ab
            shard, rows = self.linear.shards[p], self.linear.part_rows(p)
            if shard.kind == "column":
                b = shard.take(b, 0)
            else:
                a = shard.take(a, 1)
            r, lo = a.shape[0], p * self.rank
            self.a[slot, lo:lo + r].copy_(a)
            self.bt[slot, lo:lo + r, rows].copy_(b.T)
            self.ranks[slot, p] = r

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        step = self.step
        if step.token_slots is None:
            return y
        if step.kernels is not None:
            step.kernels.expand(step.kernels.shrink(x, self.a, step.token_slots), self.bt,
                                step.token_slots, y)
            return y
        if step.native:
            native.lora_add_(y, x.contiguous(), self.a, self.bt, step.token_slots,
                             self.part_cols, self.ranks, self.rank)
            return y
        n, width, mask = step.used, self.a.shape[1], step.mask
        assert mask is not None  # set by `LoraSlots.begin` off a GPU
        s = x @ self.a[:n].view(n * width, -1).T
        s = (s.view(-1, n, width) * mask[:, :, None]).view(-1, n * width)
        return y.addmm_(s.to(y.dtype), self.bt[:n].view(n * width, -1))


def step_kernels(device: torch.device) -> Any:
    """The Triton kernels on a GPU (imports triton only there), else None: the matmuls."""
    if device.type != "cuda":
        return None
    from radixserve.kernels import lora
    return lora


class LoraSlots:
    """The adapters a worker holds and their slots; `begin` sets up each step."""

    def __init__(self, model: DecoderModel, config: ModelConfig, slots: int, rank: int,
                 targets: tuple[str, ...], device: torch.device) -> None:
        self.config, self.rank, self.targets = config, rank, targets
        self.step = LoraStep()
        self.step.kernels = step_kernels(device)
        self.step.native = can_pack(device, next(model.parameters()).dtype)
        self.loaded: dict[str, LoraAdapter] = {}
        self.filled: list[str | None] = [None] * slots
        self.projections: list[tuple[int, LoraProjection]] = []
        for name, linear in model.linears().items():
            layer, fused = int(name.split(".")[1]), name.rpartition(".")[2]
            parts = FUSED.get(fused, (fused,))
            if any(p in targets for p in parts):
                linear.lora = LoraProjection(linear, parts, slots, rank, self.step)
                self.projections.append((layer, linear.lora))
        self.device = device

    @classmethod
    def create(cls, config: EngineConfig, model: DecoderModel, model_config: ModelConfig,
               device: torch.device) -> LoraSlots | None:
        """The slots `config` asks for, holding the adapters of `lora_paths` (ValueError
        naming a bad one); None when LoRA serving is off."""
        named = parse_lora_paths(config.lora_paths)
        if not (config.enable_lora or named):
            return None
        if len(named) > config.max_loaded_loras:
            raise ValueError(f"lora_paths names {len(named)} adapters, more than "
                             f"max_loaded_loras ({config.max_loaded_loras})")
        wanted = tuple(config.lora_target_modules or ())
        targets = TARGETS if "all" in wanted else wanted or TARGETS
        adapters = [load_adapter(name, path, model_config, config.max_lora_rank or 1 << 16,
                                 targets) for name, path in named.items()]
        if not wanted and adapters:  # those the adapters adapt, in the model's order
            used = {t for a in adapters for t in a.targets}
            targets = tuple(t for t in TARGETS if t in used)
        rank = config.max_lora_rank or max((a.rank for a in adapters), default=DEFAULT_RANK)
        slots = cls(model, model_config, config.max_loras_per_batch, rank, targets, device)
        slots.loaded.update((a.name, a) for a in adapters)
        return slots

    def infos(self) -> list[LoraInfo]:
        return [LoraInfo(**a.describe()) for a in self.loaded.values()]

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.bt.nbytes for _, p in self.projections)

    def load(self, name: str, path: str, drop: list[str]) -> LoraInfo:
        """Read the adapter at `path` as `name` (ValueError naming what is wrong with it),
        then forget those in `drop` (the scheduler's evictions, made room for it)."""
        adapter = load_adapter(name, path, self.config, self.rank, self.targets)
        for old in drop:
            self.unload(old)
        self.loaded[name] = adapter
        return LoraInfo(**adapter.describe())

    def unload(self, name: str) -> None:
        self.loaded.pop(name, None)
        for slot, held in enumerate(self.filled):
            if held == name:  # no step may read it any more: the slot is free
                self.filled[slot] = None

    def begin(self, batch: ForwardBatch, q_lens: torch.Tensor, tokens: int,
              to_device: Callable[[list[int], torch.device], torch.Tensor]) -> bool:
        """Fill the slots the step asks for, then set up its adapters; whether any of its
        sequences runs one. `to_device`: how the step's slots reach the device (the
        worker's staging, `worker/staging.py`)."""
        for fill in batch.lora_fills:
            adapter = self.loaded.get(fill.name)
            if adapter is None:
                raise RuntimeError(f"the scheduler filled slot {fill.slot} with LoRA adapter "
                                   f"{fill.name!r}, which this worker does not hold")
            for layer, projection in self.projections:
                projection.fill(fill.slot, adapter, layer)
            self.filled[fill.slot] = fill.name
        step = self.step
        if not any(s >= 0 for s in batch.lora_slots):
            step.token_slots = step.mask = None
            return False
        seq_slots = to_device(batch.lora_slots, self.device)
        step.token_slots = torch.repeat_interleave(seq_slots, q_lens.long(), output_size=tokens)
        step.used = max(batch.lora_slots) + 1
        if step.kernels is None and not step.native:
            slots = torch.arange(step.used, device=self.device)
            step.mask = (step.token_slots[:, None] == slots).to(self.projections[0][1].a.dtype)
        return True
