"""bench/host_overhead.py's tiny preset end to end: every phase of a decode step is timed,
the step message is measured, and the tables are written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_host_overhead_bench_tiny_preset(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "bench" / "host_overhead.py"), "--preset",
                    "tiny", "--out", str(tmp_path)], cwd=ROOT, check=True, timeout=300)
    report = json.loads((tmp_path / "host_overhead_tiny.json").read_text())
    rows = report["rows"]
    assert [r["batch"] for r in rows] == [2, 4]
    for r in rows:
        assert r["forward"] > 0 and r["prepare"] > 0 and r["schedule"] > 0
        assert r["step"] >= r["worker"] >= r["forward"]
        assert 0 < r["host_share"] < 1
    # The step message carries every sequence's block table: it grows with the batch.
    assert rows[1]["bytes"] > rows[0]["bytes"] > 0
    assert "host share" in (tmp_path / "host_overhead_tiny.md").read_text()
