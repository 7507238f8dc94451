"""What every section of bench/gpu/run.py shares: the table's rows, CUDA-event timing,
a paged KV layout of ragged lengths and the relative error against a reference."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

ROWS: list[dict[str, Any]] = []
T0 = time.perf_counter()


def row(section: str, name: str, value: Any, target: str = "", ok: bool | None = None,
        **extra: Any) -> None:
    ROWS.append(dict(section=section, name=name, value=value, target=target, ok=ok, **extra))
    shown = f"{value:.4g}" if isinstance(value, float) else value
    print(f"[{time.perf_counter() - T0:6.1f}s] {section}: {name} = {shown} {target}", flush=True)


def cuda_time(fn: Callable[[], Any], iters: int = 30, warmup: int = 3) -> float:
    """Mean seconds per call, CUDA events around `iters` back-to-back calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def paged(lens: list[int], page: int, hkv: int, d: int, dtype: torch.dtype,
          gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random caches, shuffled block tables (int32, padded with -1) and kv_lens on cuda."""
    need = [-(-n // page) for n in lens]
    nblocks = sum(need) + 1
    k = torch.randn(nblocks, page, hkv, d, generator=gen, device="cuda").to(dtype)
    v = torch.randn(nblocks, page, hkv, d, generator=gen, device="cuda").to(dtype)
    perm = torch.randperm(nblocks, generator=gen, device="cuda").to(torch.int32)
    tables = torch.full((len(lens), max(need)), -1, dtype=torch.int32, device="cuda")
    at = 0
    for b, nb in enumerate(need):
        tables[b, :nb] = perm[at:at + nb]
        at += nb
    return k, v, tables, torch.tensor(lens, dtype=torch.int32, device="cuda")


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
