"""The reference pages name what the code has: every Prometheus series the server exports is
in docs/http.md's metrics table, every `SamplingParams` field in its `sampling_params`."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

from radixserve.messages import SamplingParams
from radixserve.server.http.metrics import Metrics

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _documented_series(text: str) -> set[str]:
    """Series names in the doc, with `a_{b,c}_d` braces expanded (braces that end a name,
    `{endpoint, status}`, are its labels)."""
    text = re.sub(r"\{[a-z_, ]*\}(?![a-z_])", "", text)
    names: set[str] = set()
    for word in re.findall(r"(?:radixserve_|vllm:)[a-z0-9_{},]+", text):
        match = re.fullmatch(r"(.*?)\{([a-z_,]+)\}(.*)", word)
        options = match.group(2).split(",") if match else [""]
        names.update(f"{match.group(1)}{o}{match.group(3)}" if match else word for o in options)
    return names


def test_every_metric_is_documented() -> None:
    metrics = Metrics()
    exported = {family.name for registry in (metrics.registry, metrics.operator_registry)
                for family in registry.collect()}
    documented = {re.sub(r"_total$", "", name)
                  for name in _documented_series((DOCS / "http.md").read_text())}
    assert len(exported) > 20
    missing = sorted(exported - documented)
    assert not missing, f"series missing from docs/http.md's metrics table: {missing}"


def test_every_sampling_param_is_documented() -> None:
    text = (DOCS / "http.md").read_text()
    missing = [f.name for f in msgspec.structs.fields(SamplingParams) if f"`{f.name}`" not in text]
    assert not missing, f"docs/http.md does not describe sampling_params {missing}"
