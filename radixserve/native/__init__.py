"""radixserve's own CPU kernels (C++ here: `f32_matmul.cpp`, `quant_matmul.cpp`,
`rms_norm.cpp`, `rotary.cpp`, `decode_attention.cpp`, `shared_attention.cpp`, `lora.cpp`,
and `decode_layers.cpp`, which runs a decode step's decoder layers through the others in one
call, bound for Python by `module.cpp`),
compiled once per machine into one library.

The build is torch's own (`torch.utils.cpp_extension`: a C++ compiler and ninja on PATH,
`-O3 -march=native`) in `<cache_root>/native/<key>` (`$RADIXSERVE_CACHE`, default
`~/.cache/radixserve`), where the key hashes the sources and their path, the flags,
torch's version and the CPU's instruction sets: a later process loads the built library in well
under a second, and a change to any of them builds afresh. `scripts/setup.sh` builds it once, so
the first engine does not wait (about half a minute on 2 quiet cores). Threads are torch's
own pool (`at::parallel_for`): the sources are compiled with `-fopenmp` so that the
pool's inline OpenMP region is live, and linked to torch's libgomp, not the compiler's,
so one OpenMP runtime serves the process.

Who needs it: `--quantization int8|q4` (refused at start-up, naming what is missing,
where it cannot be built). An fp32 model on the CPU runs its projections, norms, rotary
embedding and decode attention through it where it is built, and torch's own ops (slower,
the same results up to rounding) where it is not.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch

from radixserve.local_cache import cache_root, locked

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = sorted(HERE.glob("*.cpp"))
HEADERS = sorted(HERE.glob("*.h"))
ARCH = os.environ.get("RADIXSERVE_NATIVE_ARCH", "native")
"""The `-march` the kernels are built for: `native` (this CPU's instruction sets: AVX-512
where it has them, else AVX2 and FMA, else the portable loops), or a named level such as
`x86-64-v3` (AVX2, FMA, F16C) to build and test the AVX2 kernels on an AVX-512 machine."""
CFLAGS = ["-O3", f"-march={ARCH}", "-ffp-contract=off", "-fopenmp"]
"""`-ffp-contract=off`: values round as written (the kernels' fused multiply-adds are
explicit), so dequantized weights equal `Groups.dequantize`'s."""


class BuildError(RuntimeError):
    """This machine cannot build the kernels (no compiler, no ninja, a failed compile)."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_key() -> str:
    h = hashlib.sha256()
    for src in SOURCES + HEADERS:
        h.update(src.name.encode() + src.read_bytes())
    # The checkout's path too: torch's build files name the sources by path, so two
    # checkouts sharing one build directory would rebuild it in turn.
    for part in (str(HERE), " ".join(CFLAGS), torch.__version__, _cpu_flags()):
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
    `BuildError` naming what is missing where they cannot be built."""
    # torch runs `ninja` by name: the one pip installed beside this interpreter counts too.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    cxx = os.environ.get("CXX", "c++")
    missing = [tool for tool in (cxx, "ninja") if shutil.which(tool) is None]
    if missing:
        raise BuildError(
            f"radixserve's CPU kernels are compiled once per machine and need "
            f"{' and '.join(missing)} on PATH (e.g. apt-get install g++, pip install ninja)")
    from torch.utils.cpp_extension import load as load_extension

    key = build_key()
    build = cache_root() / "native" / key
    build.mkdir(parents=True, exist_ok=True)
    # torch's own lock (a `lock` file, waited on until it goes) outlives a build that was
    # killed, and every later start then waited forever. Every build of the key takes
    # `locked` first: its holder is the only builder alive, so a `lock` file is stale.
    with locked(build / "build.flock"):
        (build / "lock").unlink(missing_ok=True)
        try:
            return load_extension(name=f"radixserve_native_{key}",
                                  sources=[str(s) for s in SOURCES], build_directory=str(build),
                                  extra_cflags=CFLAGS, extra_ldflags=_ldflags(), verbose=False)
        except Exception as e:  # the compiler's own output is in the message
            raise BuildError(f"building radixserve's CPU kernels in {build} failed: {e}") from e


@functools.cache
def available() -> bool:
    """Whether the kernels load here (a warning, once, where they do not)."""
    try:
        load()
    except BuildError as e:
        log.warning("%s; attention falls back to torch's ops", e)
        return False
    return True


def matmul(kernel: str, x: torch.Tensor, bias: torch.Tensor | None,
           *weight: torch.Tensor) -> torch.Tensor:
    """`kernel(x, *weight, bias)` (`q4_matmul`, `int8_matmul`) over `x`'s last dimension,
    any leading shape and float dtype (the kernels compute in fp32; the result comes back
    in `x`'s dtype)."""
    rows = x.reshape(-1, x.shape[-1]).float().contiguous()
    out = getattr(load(), kernel)(rows, *weight,
                                  None if bias is None else bias.float().contiguous())
    return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """`hidden += delta` (in place, if `delta` is given), then the RMSNorm of each row of
    `hidden` (`[T, D]`, contiguous fp32) times `weight`."""
    return load().add_rms_norm(hidden, delta, weight, eps)


def lora_add_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
              slots: torch.Tensor, part_cols: torch.Tensor, ranks: torch.Tensor,
              rank: int) -> None:
    """`y[t] +=` token t's LoRA adapter's share (slot `slots[t]`, -1: none) of a projection
    whose adapters' rows are `a` `[S, parts x rank, IN]` and `bt` `[S, parts x rank, OUT]`,
    part p's outputs being `part_cols[p] .. part_cols[p + 1]` and its adapter's rank
    `ranks[s, p]`; all contiguous fp32 (int64 for the indices) on the CPU."""
    load().lora_add_(y, x, a, bt, slots, part_cols, ranks, rank)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary position embedding of `x` (`[T, heads, head_dim]` fp32, head_dim contiguous)
    in place, by `cos` and `sin` (`T * head_dim` values, contiguous)."""
    load().rotary_(x, cos, sin)


MAX_HEAD_DIM = 256


def decode_attention_fits(cache: torch.Tensor) -> bool:
    """`decode_attention` reads this cache: fp32 on the CPU, a head_dim that is a multiple
    of 16 up to 256, and the kernels built."""
    head_dim = cache.shape[-1]
    return (cache.device.type == "cpu" and cache.dtype == torch.float32
            and head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM and available())


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, starts: torch.Tensor, kv_lens: torch.Tensor,
                     scale: float, row_offsets: torch.Tensor | None = None,
                     rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Query rows (`q` `[R, H, D]`) against the keys `starts[b] .. kv_lens[b]-1` of the sets
    b they read, in place from the blocks `block_tables[b]` names (`k_cache`, `v_cache`:
    `[blocks, page, kv_heads, head_dim]`, any strides with head_dim contiguous). Row b reads
    set b (a decode per sequence); with `row_offsets` (`[B+1]`), set b is read by rows
    `row_offsets[b] .. row_offsets[b+1]-1`, or with `rows` too by rows
    `rows[row_offsets[b] .. row_offsets[b+1]-1]`, a row perhaps by several sets. A set's
    keys are read once for all its rows (tree attention's shared runs,
    `shared_attention.cpp`), and a row's parts from several sets are merged. Returns each
    row's fp32 output `[R, H, D]` and natural log-sum-exp `[R, H]` over all its keys."""
    return load().decode_attention(q.float().contiguous(), k_cache, v_cache, block_tables,
                                   starts, kv_lens, scale, row_offsets, rows)
