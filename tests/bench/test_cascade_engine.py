"""bench/cascade_engine.py's CPU smoke run: both engines (tree attention on and off) serve
the grouped workload with the same greedy output, and the report's table is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cascade_engine_tiny(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "bench" / "cascade_engine.py"), "--preset",
                    "tiny", "--out", str(tmp_path)], cwd=ROOT, check=True, timeout=600)
    report = json.loads((tmp_path / "cascade_engine_tiny.json").read_text())
    assert [r["cascade"] for r in report["runs"]] == [False, True]
    assert report["agreement"] == "8/8"
    assert all(r["tok_s"] > 0 for r in report["runs"])
    assert "decode ms/step" in (tmp_path / "cascade_engine_tiny.md").read_text()
