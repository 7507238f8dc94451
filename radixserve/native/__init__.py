"""radixserve's own CPU kernels (C++, `*.cpp` here), compiled once per machine.

They register as torch ops under `torch.ops.radixserve` (`load()` makes them available);
the functions here are their Python faces.
The build is torch's own (`torch.utils.cpp_extension`, g++ and ninja, `-O3 -march=native`,
threads from torch's pool via `at::parallel_for`, so no second OpenMP runtime), in
`$RADIXSERVE_CACHE/native/<key>` (default `~/.cache/radixserve`), where the key is the
sources', torch's and the CPU's identity: a changed kernel, a new torch or another machine
builds anew, anything else loads the built library in milliseconds. `scripts/setup.sh`
builds it once so that the first engine does not wait (about a minute on 2 cores).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import platform
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))
CFLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-ffast-math", "-fno-finite-math-only"]
"""`-fopenmp-simd`: the kernels' `omp simd` loops only (threads are torch's); fast math
for reassociated (vector) sums and glibc's vector `expf`, but with infinities kept: an
empty softmax's running maximum is -inf."""


def cache_root() -> Path:
    """`$RADIXSERVE_CACHE`, else `~/.cache/radixserve` (the converted models' home too)."""
    env = os.environ.get("RADIXSERVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "radixserve"


def _cpu_identity() -> str:
    """The CPU's model and flags: `-march=native` code runs only where it was built."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))


def build_key() -> str:
    h = hashlib.sha256()
    for src in SOURCES:
        h.update(src.name.encode() + src.read_bytes())
    h.update(" ".join(CFLAGS).encode() + torch.__version__.encode() + _cpu_identity().encode())
    return h.hexdigest()[:16]


@functools.cache
def load() -> None:
    """Build (first time on this machine) and load the kernels; RuntimeError naming what
    is missing where they cannot be built."""
    from torch.utils import cpp_extension

    # torch runs `ninja` by name: the one pip installed beside this interpreter counts too.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    key = build_key()
    build_dir = cache_root() / "native" / key
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(name=f"radixserve_native_{key}", sources=[str(s) for s in SOURCES],
                           extra_cflags=CFLAGS, extra_ldflags=["-lm"], build_directory=str(build_dir),
                           is_python_module=False, verbose=False)
    except (OSError, RuntimeError, ImportError) as e:
        raise RuntimeError(f"radixserve's CPU kernels ({', '.join(s.name for s in SOURCES)}) "
                           f"could not be built in {build_dir}: they need g++ and ninja "
                           f"(pip's ninja is in the project's dependencies): {e}") from e


@functools.cache
def available() -> bool:
    """Whether the kernels load here; where they cannot be built the callers fall back to
    torch's own ops (slower), and say so once."""
    try:
        load()
    except RuntimeError as e:
        log.warning("%s; falling back to torch's ops", e)
        return False
    return True


MAX_HEAD_DIM = 256


def decode_attention_fits(cache: torch.Tensor) -> bool:
    """`decode_attention` reads this cache: fp32 on the CPU, a head_dim that is a multiple
    of 16 up to 256, and the kernels built."""
    head_dim = cache.shape[-1]
    return (cache.device.type == "cpu" and cache.dtype == torch.float32
            and head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM and available())


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, starts: torch.Tensor, kv_lens: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One query token per sequence (`q` `[B, H, D]`) against its keys `starts[b] ..
    kv_lens[b]-1`, read in place from the blocks `block_tables` names (`k_cache`,
    `v_cache`: `[blocks, page, kv_heads, head_dim]`, any strides with head_dim
    contiguous). Returns the fp32 output `[B, H, D]` and natural log-sum-exp `[B, H]`."""
    return torch.ops.radixserve.decode_attention(
        q.float().contiguous(), k_cache, v_cache, block_tables, starts, kv_lens, scale)
