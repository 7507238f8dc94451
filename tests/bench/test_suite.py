"""The suite's shape (issue 51): every record under bench/results/ has its command in the
index (bench/studies.py), or the deleted study that made it; every study the index names is
a script there; `python -m bench` prints the index; bench/ stays within 6,000 lines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.studies import HISTORICAL, STUDIES, commands

ROOT = Path(__file__).resolve().parents[2]
MAX_BENCH_LINES = 6000


def test_every_record_has_its_command() -> None:
    records = {p.stem for p in (ROOT / "bench" / "results").glob("*.json")}
    assert records == set(commands()), (f"records without a command: {records - set(commands())}"
                                        f"; commands without a record: {set(commands()) - records}")


def test_every_study_is_a_script_and_every_historical_one_is_gone() -> None:
    assert all((ROOT / "bench" / f"{name}.py").is_file() for name in STUDIES)
    scripts = {cmd.split()[0] for cmd in HISTORICAL.values()}
    assert not [s for s in scripts if (ROOT / s).exists()], "a historical study still exists"


def test_the_entry_point_lists_the_studies() -> None:
    out = subprocess.run([sys.executable, "-m", "bench"], cwd=ROOT, capture_output=True,
                         text=True, check=True, timeout=60).stdout
    assert all(name in out for name in STUDIES) and "python -m bench run --preset quick" in out


def test_bench_stays_within_its_budget() -> None:
    lines = sum(len(p.read_text().splitlines()) for p in (ROOT / "bench").rglob("*.py")
                if "results" not in p.relative_to(ROOT / "bench").parts)
    assert lines <= MAX_BENCH_LINES, f"bench/ holds {lines} lines of Python"
