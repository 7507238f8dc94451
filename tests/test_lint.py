"""The linters the house keeps clean (configured in pyproject.toml): ruff over every file,
mypy over the package (radixserve). Each runs from the
repository root as the suite's own Python has it, and a failure shows what it found.
mypy keeps its cache in `.mypy_cache` (gitignored), so a second run reads only what
changed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_ruff_is_clean():
    result = _run("ruff", "check", ".")
    assert result.returncode == 0, f"ruff check found:\n{result.stdout}{result.stderr}"


def test_mypy_is_clean():
    # Files and settings come from [tool.mypy]; its cache_dir is .mypy_cache.
    result = _run("mypy")
    assert result.returncode == 0, f"mypy found:\n{result.stdout}{result.stderr}"
    assert "Success: no issues found" in result.stdout, result.stdout
