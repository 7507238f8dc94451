"""bench/tp.py's tiny preset end to end: both engines step, rank 0's collectives are
timed, and the report carries the issue's figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tp_bench_tiny_preset(tmp_path: Path) -> None:
    # Its own process: Engine(tp_size=2) sets torch's threads for the process it runs in.
    subprocess.run([sys.executable, str(ROOT / "bench" / "tp.py"), "--preset", "tiny",
                    "--out", str(tmp_path)], cwd=ROOT, check=True, timeout=120)
    report = json.loads((tmp_path / "tp_tiny.json").read_text())
    layers = report["model_config"]["num_layers"]
    assert [r["batch"] for r in report["rows"]] == [1, 8]
    for r in report["rows"]:
        runs = ("n1", "n1_rank_threads", "n2", "n2_gloo")
        assert min(r[f"{run}_step_ms"] for run in runs) > 0
        assert r["ratio"] > 0 and r["ratio_rank_threads"] > 0 and r["ratio_shm_gloo"] > 0
        for run in ("n2", "n2_gloo"):
            calls = {name: c["calls"] for name, c in r["collectives"][run].items()}
            # The embedding's all-reduce and two a layer, the logits' gather, the step.
            assert calls == {"all_reduce": 2 * layers + 1, "gather_columns": 1, "share": 1}
            assert 0 < r["collectives"][run]["all_reduce"]["share"] < 1
        assert r["alone"]["shm"]["ms"] > 0 and r["alone"]["gloo"]["ms"] > 0
    assert report["verdict"]["batch"] == 8
    assert report["limits"]["read_gbs"] > 0 and report["machine"]["commit"]
    assert "10% bound" in (tmp_path / "tp_tiny.md").read_text()
