"""bench/gpu/run.py's step section, as the CPU smoke run: every configuration serves the
workload, the decode step is timed at each batch, transformers' `generate` runs beside it,
and greedy output agrees across the configurations (on the CPU graphs and overlap are off:
one path)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_step_tiny_on_the_cpu(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "run.py"), "--sections", "step",
                    "--tiny", "--out", str(tmp_path)], cwd=ROOT, check=True, timeout=600)
    report = json.loads((tmp_path / "e2e" / "gpu_e2e.json").read_text())
    assert [r["config"] for r in report["runs"]] == [
        "graphs + overlap", "graphs, no overlap", "overlap, no graphs", "neither"]
    for r in report["runs"]:
        assert r["tok_s"] > 0 and r["agreement"] == "4/4"
        assert set(r["ms_per_step"]) == {"1", "4"}
    assert report["transformers"]["tok_s"] > 0
    assert "x transformers" in (tmp_path / "e2e" / "gpu_e2e.md").read_text()
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    assert not [r for r in rows if r["name"] == "FAILED"]
