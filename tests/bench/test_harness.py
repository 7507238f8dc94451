"""The benchmark harness itself: deterministic workloads, metrics on a known timeline,
runners driven through waves, reports written. No model: a fake tokenizer and runner."""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import pytest

from bench import report as reporting
from bench.metrics import (RequestRecord, agreement, cache_hit_rate, hit_rate_over_time,
                           percentile, summarize)
from bench.runners.base import Completion, Runner
from bench.workloads import PRESETS, WORKLOADS, Request, make_workload


def fake_encode(text: str) -> list[int]:
    """Deterministic across processes (unlike hash()): one id per whitespace word or marker."""
    return [zlib.crc32(w.encode()) % 49_000 + 100 for w in text.replace("\n", " \n ").split()]


# ---------------------------------------------------------------- workloads

@pytest.mark.parametrize("name", WORKLOADS)
def test_workloads_are_deterministic_from_the_seed(name: str) -> None:
    a = make_workload(name, "quick", fake_encode, seed=3)
    b = make_workload(name, "quick", fake_encode, seed=3)
    c = make_workload(name, "quick", fake_encode, seed=4)
    assert a.requests == b.requests
    assert [r.segment for r in a.requests] != [r.segment for r in c.requests]
    assert dict(a.settings) == PRESETS[name]["quick"]


@pytest.mark.parametrize("name", WORKLOADS)
def test_workload_structure(name: str) -> None:
    w = make_workload(name, "quick", fake_encode)
    rids = [r.rid for r in w.requests]
    assert len(set(rids)) == len(rids)
    seen: set[str] = set()
    for r in w.requests:
        assert r.parent is None or r.parent in seen, "a parent must arrive before its child"
        seen.add(r.rid)
        assert r.output_tokens == w.settings["output_tokens"]
        if r.prefix_key is not None:
            assert 0 < r.shared_len < len(r.segment)
    by_key: dict[str, list[Request]] = {}
    for r in w.requests:
        if r.prefix_key is not None:
            by_key.setdefault(r.prefix_key, []).append(r)
    for members in by_key.values():
        prefix = members[0].segment[:members[0].shared_len]
        assert all(m.segment[:m.shared_len] == prefix for m in members)


def test_workload_sizes() -> None:
    s = PRESETS["shared_prefix"]["quick"]
    w = make_workload("shared_prefix", "quick", fake_encode)
    assert w.num_requests == s["groups"] * s["per_group"]
    assert {len(r.segment) for r in w.requests} == {s["system_tokens"] + s["question_tokens"]}
    assert len({r.segment[:s["system_tokens"]] for r in w.requests}) == s["groups"]
    ns = make_workload("no_sharing", "quick", fake_encode)
    first_pages = {r.segment[:16] for r in ns.requests}
    assert len(first_pages) == ns.num_requests, "control prompts must not share a page"
    assert {len(r.segment) for r in ns.requests} == {s["system_tokens"] + s["question_tokens"]}


def test_waves_and_prompts_follow_the_conversation() -> None:
    w = make_workload("multi_turn", "tiny", fake_encode)
    waves = w.waves()
    assert len(waves) == w.settings["turns"]
    assert all(len(wave) == w.settings["conversations"] for wave in waves)
    first, second = waves[0][0], waves[1][0]
    prompts = {first.rid: w.prompt(first, {}, {})}
    outputs = {first.rid: [1, 2, 3, 4]}
    want = prompts[first.rid] + [1, 2, 3, 4] + list(second.segment)
    assert w.prompt(second, prompts, outputs) == want


# ---------------------------------------------------------------- metrics

def rec(rid: str, submit: float, first: float, finish: float, prompt: int = 10, cached: int = 0,
        output: int = 5) -> RequestRecord:
    return RequestRecord(rid, 0, 0, prompt, cached, output, submit, first, finish)


def test_percentile_interpolates_linearly() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([3, 1, 2], 0) == 1 and percentile([3, 1, 2], 100) == 3
    assert percentile([10.0], 99) == 10.0
    assert percentile(range(101), 99) == pytest.approx(99.0)
    assert math.isnan(percentile([], 50))


def test_metrics_on_a_known_timeline() -> None:
    # Three requests submitted at 0, 0 and 1 s; 5 output tokens each.
    records = [rec("a", 0.0, 1.0, 3.0, prompt=100, cached=0),
               rec("b", 0.0, 2.0, 4.0, prompt=100, cached=50),
               rec("c", 1.0, 2.0, 6.0, prompt=200, cached=150)]
    s = summarize(records)
    assert s["wall_s"] == 6.0
    assert s["output_tokens"] == 15 and s["prompt_tokens"] == 400
    assert s["output_tok_s"] == pytest.approx(15 / 6)
    assert s["total_tok_s"] == pytest.approx(415 / 6)
    assert s["requests_s"] == pytest.approx(0.5)
    assert s["ttft_p50_s"] == pytest.approx(1.0)  # ttfts 1, 2, 1
    assert s["ttft_p99_s"] == pytest.approx(1.98)  # 1 + 0.98 * (2 - 1)
    # tpot: (3-1)/4 = 0.5, (4-2)/4 = 0.5, (6-2)/4 = 1.0
    assert s["tpot_p50_s"] == pytest.approx(0.5)
    assert s["tpot_p99_s"] == pytest.approx(0.5 + 0.98 * 0.5)
    assert s["cache_hit_rate"] == pytest.approx(200 / 400)
    assert hit_rate_over_time(records) == [(1.0, 0.0), (2.0, 50 / 200), (2.0, 200 / 400)]
    assert cache_hit_rate([]) == 0.0


def test_tpot_needs_two_tokens() -> None:
    assert rec("x", 0, 1, 1, output=1).tpot is None
    assert math.isnan(summarize([rec("x", 0, 1, 1, output=1)])["tpot_p50_s"])


def test_agreement() -> None:
    assert agreement({"a": [1], "b": [2]}, {"a": [1], "b": [3]}) == 0.5
    assert math.isnan(agreement({"a": [1]}, {}))


# ---------------------------------------------------------------- runners and reports

class FakeRunner(Runner):
    """Echoes a function of the prompt as output; time advances on a fake clock."""

    def __init__(self, name: str, step: float = 0.1, cached: bool = False) -> None:
        self.name, self.step, self.cached = name, step, cached
        self.clock = 100.0
        self.seen: list[list[int]] = []

    def generate(self, prompts: list[list[int]], requests: list[Request]) -> list[Completion]:
        out = []
        submitted = self.clock
        for prompt, req in zip(prompts, requests):
            self.seen.append(prompt)
            self.clock += self.step
            first = self.clock
            self.clock += self.step * (req.output_tokens - 1)
            out.append(Completion([len(prompt) % 97 + i for i in range(req.output_tokens)],
                                  req.shared_len if self.cached else 0, submitted, first,
                                  self.clock))
        return out


def test_runner_drives_waves_with_its_own_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.runners.base as base

    w = make_workload("agent", "tiny", fake_encode)
    runner = FakeRunner("fake")
    monkeypatch.setattr(base.time, "perf_counter", lambda: 100.0)  # run starts at clock 100
    result = runner.run(w)
    assert len(result.records) == w.num_requests
    by_rid = {r.rid: r for r in w.requests}
    for req in w.requests:
        if req.parent is not None:
            parent_prompt = runner.seen[[r.rid for r in w.requests].index(req.parent)]
            child = runner.seen[[r.rid for r in w.requests].index(req.rid)]
            segment = list(by_rid[req.rid].segment)
            assert child == parent_prompt + result.outputs[req.parent] + segment
    assert result.records[0].submit_s == 0.0 and result.records[0].ttft == pytest.approx(0.1)
    assert result.peak_rss_mb > 0


def test_report_files_and_table(tmp_path: Path) -> None:
    workloads = {}
    for name in ("shared_prefix", "no_sharing"):
        w = make_workload(name, "tiny", fake_encode)
        results = {n: FakeRunner(n, step=s, cached=c).run(w) for n, s, c in (
            ("radixserve", 0.01, True), ("radixserve-nocache", 0.02, False),
            ("hf-generate", 0.04, False), ("hf-prefix-reuse", 0.03, True))}
        ref = results["radixserve"]
        workloads[name] = {"settings": dict(w.settings), "runs": {
            n: reporting.run_entry(r, ref) for n, r in results.items()}}
    report = {"preset": "tiny", "settings": {"model": "fake"}, "workloads": workloads,
              "machine": {"commit": "abc", "cpu": "cpu", "cores": 2, "torch_threads": 1,
                          "loadavg_at_start": (0.5, 0.5, 0.5), "torch": "t", "transformers": "x"},
              "limits": {"matmul_gflops": 90.0, "read_gbs": 20.0, "copy_gbs": 20.0},
              "probes": {"prefill": {"prompt_tokens": 512, "tokens_per_s": 250.0, "gflops": 60.0,
                                     "fraction_of_matmul": 0.6}}}
    for name, cpu in (("radixserve", 1.0), ("hf-generate", 5.0), ("hf-prefix-reuse", 2.0)):
        workloads["shared_prefix"]["runs"][name]["cpu_s"] = cpu
    paths = reporting.write(report, tmp_path / "tiny")
    names = {p.name for p in paths}
    assert names == {"tiny.json", "tiny.md", "tiny_throughput.png", "tiny_ttft.png",
                     "tiny_hit_rate.png"}
    assert all(p.stat().st_size > 0 for p in paths)
    md = (tmp_path / "tiny.md").read_text()
    for w in workloads:
        for r in ("radixserve", "radixserve-nocache", "hf-generate", "hf-prefix-reuse"):
            assert f"| {w} | {r} |" in md
    saved = json.loads((tmp_path / "tiny.json").read_text())
    targets = {t["target"]: t for t in saved["targets"]}
    # Bounds: >= 6x hf-generate, >= 3x hand-rolled prefix reuse.
    ratio = targets["shared_prefix: radixserve / hf-generate output tok/s"]
    assert ratio["value"] == pytest.approx(4.0, rel=0.05) and not ratio["met"]
    cpu = targets["shared_prefix: radixserve / hf-generate output tokens per CPU-second (check)"]
    assert cpu["value"] == pytest.approx(5.0) and not cpu["met"]
    cpu = targets["shared_prefix: radixserve / hf-prefix-reuse output tokens per CPU-second "
                  "(check)"]
    assert cpu["value"] == pytest.approx(2.0) and not cpu["met"]
    ratio = targets["shared_prefix: radixserve / hf-prefix-reuse output tok/s"]
    assert ratio["value"] == pytest.approx(3.0) and ratio["met"] == (ratio["value"] >= 3)
    assert targets["prefill: fraction of fp32 matmul rate"]["met"]
    assert reporting.markdown(saved) == md  # the table can be redrawn from the JSON
