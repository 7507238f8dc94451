"""The native kernels' AVX2 paths (issue 57: most desktops, laptops and AMD servers before
Zen 4 have AVX2 and FMA but no AVX-512), held to the same checks as the build this machine
runs: the kernels built for `-march=x86-64-v3` (`RADIXSERVE_NATIVE_ARCH`) in a process of
their own, which runs the kernel tests (GEMVs fp32, q4 and int8 against their fp32
matmuls, norm, rotary, decode attention and tree attention's shared runs against softmax
attention, a decode step's layers in one call against the modules), greedy decoding equal
to transformers token for token (fp32), and the q4 model's greedy tokens and logprobs near
its dequantized fp32 reference. An AVX-512 machine runs AVX2 code, so the paths are tested
wherever the suite runs on x86 with AVX2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _has_avx2() -> bool:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return {"avx2", "fma", "f16c"} <= set(flags)


pytestmark = pytest.mark.skipif(not _has_avx2(), reason="this CPU runs no AVX2 code")

CHECKS = ["tests/model/test_native_layers.py", "tests/worker/test_native_decode.py",
          "tests/model/test_native_decode_layers.py",
          "tests/model/test_quantization.py::test_quantized_matmuls_equal_the_fp32_matmul_of_"
          "their_weights",
          "tests/model/test_quantization.py::test_engine_greedy_and_logprobs_near_the_"
          "dequantized_fp32_model[q4-torch-paged]",
          "tests/test_engine_exact.py::TestAgainstTransformers::test_one_prompt",
          "tests/test_engine_exact.py::TestAgainstTransformers::test_batch_of_16_mixed_lengths"]


def test_the_avx2_kernels_pass_the_kernel_and_exactness_tests() -> None:
    env = {**os.environ, "RADIXSERVE_NATIVE_ARCH": "x86-64-v3"}
    isa = subprocess.run([sys.executable, "-c", "from radixserve import native; "
                          "print(native.load().isa())"], cwd=ROOT, env=env, text=True,
                         capture_output=True, timeout=900)
    assert isa.stdout.strip() == "avx2", isa.stderr[-3000:]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          *CHECKS], cwd=ROOT, env=env, text=True, capture_output=True,
                         timeout=1200)
    assert run.returncode == 0, run.stdout[-6000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], \
        run.stdout[-2000:]
