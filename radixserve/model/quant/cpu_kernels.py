"""The quantized formats' CPU kernels (`cpu_kernels.cpp`), compiled once per machine.

`load()` builds the C++ file as a torch extension with the machine's compiler (ninja and a
C++ compiler on PATH, `-O3 -march=native`) into `<cache_root>/cpu_kernels/<key>`, where
the key hashes the source, the flags, torch's version and the CPU's instruction sets: a
later process (or a later run) loads the built library in well under a second, and a
change to any of them builds afresh. Only `int8` and `q4` need it; fp32 never does.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]
"""`-ffp-contract=off`: the dequantized values round as `Int4Groups.dequantize` does (the
kernels' own fused multiply-adds are explicit). `-fopenmp` only compiles torch's inline
`at::parallel_for` region; the library links torch's libgomp (`_ldflags`)."""


class KernelBuildError(RuntimeError):
    """The machine cannot build the quantized kernels (no compiler, no ninja, a failed
    compile)."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def build_key() -> str:
    h = hashlib.sha256(SOURCE.read_bytes())
    for part in (" ".join(CFLAGS), torch.__version__, _cpu_flags()):
        h.update(part.encode())
    return h.hexdigest()[:16]


def _ldflags() -> list[str]:
    """torch's own libgomp (the one its thread pool runs), not the compiler's: both are
    `libgomp.so.1`, so the loader maps the one torch already loaded."""
    lib = Path(torch.__file__).parent / "lib"
    return [f"-L{lib}", "-l:libgomp.so.1"] if (lib / "libgomp.so.1").exists() else []


@functools.cache
def load() -> ModuleType:
    """The compiled kernels (built here first if this machine has no build of this key);
    `KernelBuildError` naming what is missing where they cannot be built."""
    from radixserve.model.loader import cache_root

    cxx = os.environ.get("CXX", "c++")
    missing = [tool for tool in (cxx, "ninja") if shutil.which(tool) is None]
    if missing:
        raise KernelBuildError(
            f"quantization int8/q4 compiles its CPU kernels once per machine and needs "
            f"{' and '.join(missing)} on PATH (e.g. apt-get install g++ ninja-build, or "
            f"pip install ninja); quantization='none' needs neither")
    from torch.utils.cpp_extension import load as load_extension

    key = build_key()
    build = cache_root() / "cpu_kernels" / key
    build.mkdir(parents=True, exist_ok=True)
    try:
        return load_extension(name=f"radixserve_cpu_kernels_{key}", sources=[str(SOURCE)],
                              build_directory=str(build), extra_cflags=CFLAGS,
                              extra_ldflags=_ldflags(), verbose=False)
    except Exception as e:  # the compiler's own output is in the message
        raise KernelBuildError(f"building {SOURCE.name} in {build} failed: {e}") from e


def run(kernel, x: torch.Tensor, bias: torch.Tensor | None,
        *weight: torch.Tensor) -> torch.Tensor:
    """`kernel(x, *weight, bias)` over `x`'s last dimension, any leading shape and float
    dtype (the kernels compute in fp32; the result comes back in `x`'s dtype)."""
    rows = x.reshape(-1, x.shape[-1]).float().contiguous()
    out = kernel(rows, *weight, None if bias is None else bias.float().contiguous())
    return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])
