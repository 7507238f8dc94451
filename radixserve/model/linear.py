"""The one projection layer of every decoder: a (possibly fused, possibly sharded) linear
map whose weight is held in one of several formats.

Weights load dense (`load`, one fused part at a time, already sliced to this rank's shard),
then `quantize` or `pack` turns them into the format the forward runs:
- dense: `nn.functional.linear` (any device and dtype), or, on a CPU in fp32 (`pack`), this
  project's kernel: a GEMV at decode's batch sizes, which reads the weight once at close
  to the machine's bandwidth, and sgemm beyond;
- `int8` and `q4`: weight-only, 8-bit (`quant/int8.py`) or 4-bit (`quant/int4.py`) codes
  with one scale and low per 32 inputs (`quant/groups.py`); `q4` from a GGUF's own blocks
  where the file has them, else, as every `int8` weight, quantized from the float weights.
Both quantized formats run fp32 activations through `radixserve/native/quant_matmul.cpp`: the fp32
matmul of the dequantized weight, up to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Protocol, TypeVar

import torch
from torch import nn

import radixserve.native as native
from radixserve.config import QUANTIZATIONS
from radixserve.model.quant.groups import Groups
from radixserve.model.quant.int4 import Int4Weight
from radixserve.model.quant.int8 import Int8Weight

Weights = TypeVar("Weights", torch.Tensor, Groups)


@dataclass(frozen=True)
class ShardSpec:
    """This rank's slice of a layer's full weight (tensor parallelism, Megatron-style).

    `column`: the output rows are split, each fused part alike (a rank holds its share of
    q, k and v, or of gate and up), and the bias with them. `row`: the input columns are
    split; each rank's output is a partial sum for the caller to all-reduce, and only
    rank 0 holds the bias (the others hold zeros) so that the sum adds it once. The default
    (one rank) is the whole weight."""

    kind: Literal["column", "row"] = "column"
    rank: int = 0
    world: int = 1

    @property
    def dim(self) -> int:
        """The weight dimension this spec splits: 0 (outputs) or 1 (inputs)."""
        return 0 if self.kind == "column" else 1

    def size(self, n: int, dim: int) -> int:
        """This rank's share of a dimension of `n`; ValueError where it does not divide."""
        if dim != self.dim or self.world == 1:
            return n
        if n % self.world:
            raise ValueError(f"a {self.kind}-parallel dimension of {n} does not divide "
                             f"across {self.world} ranks")
        return n // self.world

    def take(self, t: Weights, dim: int) -> Weights:
        """This rank's slice of `t` along `dim` (whole `t` where `dim` is not split)."""
        n = self.size(t.shape[dim], dim)
        return t if n == t.shape[dim] else t.narrow(dim, self.rank * n, n)


class PackedWeight(Protocol):
    @property
    def nbytes(self) -> int: ...

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


class LoraAdd(Protocol):
    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` plus the step's adapters' share for the input `x` (in place)."""
        ...


class Linear(nn.Module):
    """`y = x W^T + b` over `parts` (the output sizes of fused projections, e.g. q, k, v).
    `shard`: this rank's cut, one for all parts or one per part (column-parallel k and v
    cut by KV head while q is cut by query head, `model/shards.py`)."""

    def __init__(self, in_features: int, parts: int | tuple[int, ...], bias: bool = False,
                 shard: ShardSpec | tuple[ShardSpec, ...] = ShardSpec()) -> None:
        super().__init__()
        full = (parts,) if isinstance(parts, int) else parts
        self.shards = shard if isinstance(shard, tuple) else (shard,) * len(full)
        if len(self.shards) != len(full) or len({s.kind for s in self.shards}) != 1:
            raise ValueError("one shard per part, all of one kind")
        self.parts = tuple(s.size(p, 0) for s, p in zip(self.shards, full))
        out = sum(self.parts)
        self.in_local = self.shards[0].size(in_features, 1)
        """This rank's input features (a row-parallel projection's share)."""
        self.weight = nn.Parameter(torch.empty(out, self.in_local))
        self.bias = nn.Parameter(torch.empty(out)) if bias else None
        self.packed: PackedWeight | None = None
        self.lora: LoraAdd | None = None
        """Adapters added to the output (`lora/slots.py`), when the server serves any."""

    def part_rows(self, part: int) -> slice:
        start = sum(self.parts[:part])
        return slice(start, start + self.parts[part])

    @torch.no_grad()
    def load(self, name: Literal["weight", "bias"], part: int, full: torch.Tensor) -> None:
        """Copy this rank's slice of one part's full weight (or bias) in."""
        rows, shard = self.part_rows(part), self.shards[part]
        if name == "weight":
            self.weight[rows].copy_(shard.take(shard.take(full, 0), 1))
        elif self.bias is None:
            raise ValueError("this projection has no bias to load")
        elif shard.kind == "row" and shard.rank > 0:
            self.bias[rows].zero_()
        else:
            self.bias[rows].copy_(shard.take(full, 0))

    def quantize(self, method: str, file_parts: list[Groups | None] | None = None) -> int:
        """Replace the dense weight by `method`'s format (`int8` or `q4`). `file_parts`
        gives a part's full groups as its file holds them (None: quantize that part from its
        float weight). Returns how many parts were quantized here."""
        formats: dict[str, tuple[int, Callable[[Groups], PackedWeight]]] = {
            "int8": (8, Int8Weight), "q4": (4, Int4Weight)}
        if method not in formats:
            raise ValueError(f"unknown quantization {method!r}; known: {QUANTIZATIONS}")
        bits, packed = formats[method]
        file_parts = file_parts or [None] * len(self.parts)
        groups = [Groups.quantize(self.weight[self.part_rows(i)], bits) if g is None
                  else self.shards[i].take(self.shards[i].take(g, 0), 1)
                  for i, g in enumerate(file_parts)]
        self._replace(packed(Groups.cat(groups)))
        return sum(g is None for g in file_parts)

    def pack(self) -> None:
        """Run a dense CPU fp32 weight through this project's kernel (see the module
        docstring)."""
        self._replace(F32Weight(self.weight))

    def _replace(self, packed: PackedWeight) -> None:
        self.packed = packed
        self.weight.data = self.weight.data.new_empty(0)  # one copy of the weights, not two

    @property
    def weight_bytes(self) -> int:
        """Bytes a forward reads of the weight, in the format it runs."""
        return self.weight.nbytes if self.packed is None else self.packed.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            y = nn.functional.linear(x, self.weight, self.bias)
        else:
            y = self.packed.matmul(x, self.bias)
        return y if self.lora is None else self.lora.add(x, y)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `pack` runs here: fp32 on a CPU that builds this project's kernels."""
    return device.type == "cpu" and dtype == torch.float32 and native.available()


class F32Weight:
    """A dense fp32 CPU weight run by `radixserve/native/f32_matmul.cpp`: its own GEMV up to
    128 rows (one read of the weight, both cores), sgemm beyond.
    Results differ from `nn.functional.linear`'s only in rounding (~1e-6 relative). The
    weight stays in its plain layout, so a tied LM head shares the embedding's storage."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.detach().contiguous()
        self.nbytes = self.weight.nbytes

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return native.matmul("f32_matmul", x, bias, self.weight)
