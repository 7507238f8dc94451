"""The native kernels' build cache (`radixserve/native/__init__.py`): a build killed midway
leaves torch's `lock` file behind, which made every later start wait for it forever."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import radixserve.native as native
from radixserve.local_cache import cache_root

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not native.available(), reason="the CPU kernels do not build here")


def test_a_killed_builds_lock_does_not_hang_the_next_start(tmp_path) -> None:
    built = cache_root() / "native" / native.build_key()
    copy = tmp_path / "native" / native.build_key()
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("lock", "build.flock"))
    (copy / "lock").touch()  # what a build killed while it held torch's lock leaves
    env = {**os.environ, "RADIXSERVE_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", "import radixserve.native as n; "
                           "print(n.load().isa())"], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() in ("avx512", "avx2", "portable")
    assert not (copy / "lock").exists()
