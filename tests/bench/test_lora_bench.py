"""bench/lora.py's CPU smoke run: the base alone, 1 and 4 adapters and PEFT's generate serve
the workload, PEFT's greedy outputs equal radixserve's, and the report is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_lora_bench_tiny(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "bench" / "lora.py"), "--preset", "tiny",
                    "--out", str(tmp_path)], cwd=ROOT, check=True, timeout=600)
    report = json.loads((tmp_path / "lora_tiny.json").read_text())
    assert [(r["name"], r["adapters"]) for r in report["runs"]] == [
        ("base alone", 0), ("radixserve", 1), ("radixserve", 4), ("transformers + PEFT", 4)]
    assert report["agreement"] == "8/8"
    assert all(r["tok_s"] > 0 for r in report["runs"])
    assert "vs base alone" in (tmp_path / "lora_tiny.md").read_text()
