"""bench/router.py's front-end smoke run on a tiny model: one replica alone, radixserve's
router and SGLang's (`smg`, skipped without sglang-router) serve the workload over HTTP
with equal greedy outputs, and every figure comes as a ratio to the single replica."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.factories import tiny_model_dir
from tests.server.sglang_router import smg

ROOT = Path(__file__).resolve().parents[2]
FIGURES = {"hit_rate", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s"}


def test_router_fronts_smoke(tmp_path: Path) -> None:
    if smg() is None:
        pytest.skip("sglang-router is not installed (the test extra)")
    model = tiny_model_dir(tmp_path / "models")
    subprocess.run([sys.executable, str(ROOT / "bench" / "router.py"), "--preset", "fronts_smoke",
                    "--model", str(model), "--out", str(tmp_path)], cwd=ROOT, check=True,
                   timeout=600)
    report = json.loads((tmp_path / "router_fronts.json").read_text())
    fronts = report["fronts"]
    assert list(fronts) == ["single", "radixserve", "sglang"] and report["outputs_equal"]
    assert fronts["single"]["vs_base"] == dict.fromkeys(FIGURES, 1.0)
    assert all(set(f["vs_base"]) == FIGURES and f["output_tokens"] > 0 for f in fronts.values())
    assert set(report["sglang_vs_radixserve"]) == FIGURES
    assert fronts["single"]["hit_rate"] > 0  # a group's later requests find its prefix
    assert "SGLang's router against radixserve's" in (tmp_path / "router_fronts.md").read_text()
