"""bench/batched_decode.py's arithmetic and report, without a server: the steady-state
window counts only the steps every stream decodes in, the floor is the longer of the bytes
a step reads and the FLOPs it does, and the table states each figure's share of it."""

from __future__ import annotations

import pytest

from bench.batched_decode import BATCHES, floor_ms, markdown, steady_window


def test_the_window_starts_when_the_last_stream_decodes_and_ends_with_the_first() -> None:
    # One token a second per stream; the second stream's prefill ends a second later, the
    # third's (a long wait, as behind other prompts) at 3 s after a token the others made.
    arrivals = [[1.0, 2.0, 3.0, 4.0, 5.0], [2.0, 3.0, 4.0, 5.0, 6.0], [3.0, 4.0, 5.0, 6.0]]
    tokens, seconds = steady_window(arrivals)
    assert (tokens, seconds) == (6, 2.0)  # steps at 4 s and 5 s, three streams each
    assert steady_window([[0.5, 1.0, 1.5]]) == (2, 1.0)  # one stream: all after its first


def test_the_floor_is_the_longer_of_memory_and_compute() -> None:
    limits = {"read_gbs": 10.0, "matmul_gflops": 100.0}
    one = floor_ms(limits, weight_bytes=10 ** 9, kv_token_bytes=1000, params=10 ** 8,
                   batch=1, context=1000, shared=900)
    assert one["memory_ms"] == pytest.approx(100.1)  # 1 GB + 1 MB of KV at 10 GB/s
    assert one["compute_ms"] == pytest.approx(2.0)
    assert one["floor_ms"] == one["floor_prefix_once_ms"] == one["memory_ms"]
    many = floor_ms(limits, weight_bytes=10 ** 6, kv_token_bytes=1000, params=10 ** 8,
                    batch=32, context=1000, shared=900)
    assert many["memory_ms"] == pytest.approx(3.3)  # 32 streams' KV, 1 MB each
    assert many["memory_prefix_once_ms"] == pytest.approx(0.1 + 0.09 + 0.32)
    assert many["compute_ms"] == pytest.approx(64.0)
    assert many["floor_ms"] == many["floor_prefix_once_ms"] == many["compute_ms"]


def test_the_report_gives_each_figure_its_share_of_the_floor_and_the_goals() -> None:
    def figure(tok_s: float, batch: int, floor: float) -> dict:
        step = 1e3 * batch / tok_s
        return {"tok_s": tok_s, "step_ms": step, "server_step_ms": step, "floor": {
            "floor_ms": floor, "floor_prefix_once_ms": floor / 2, "compute_ms": 1.0}}

    sides = {"radixserve": {str(b): figure(40.0 * b, b, 20.0) for b in BATCHES},
             "llama-server": {str(b): figure(20.0 * b, b, 10.0) for b in BATCHES}}
    report = {"preset": "quick", "model": "m", "llama_server": "version: 1",
              "settings": {"batches": BATCHES, "threads": 2, "new": 16, "repeats": 1},
              "machine": {"commit": "abc", "cpu": "cpu", "cores": 2,
                          "loadavg_at_start": (1.0, 1.0, 1.0)},
              "limits": {"matmul_gflops": 100.0, "read_gbs": 10.0},
              "limits_end": {"matmul_gflops": 90.0, "read_gbs": 12.0},
              "uptime_at_start": "up", "uptime_at_end": "up", "precisions": {"q4": sides}}
    md = markdown(report)
    # radixserve: 25 ms a step against a 20 ms floor (80%); llama-server 50 against 10.
    assert "| q4 | 1 | radixserve | 40.0 | 25.0 | 25.0 | 20.0 | 80% | 10.0 | 40% | 1.0 " \
           "| 75%: met |" in md
    assert "| q4 | 8 | llama-server | 160.0 | 50.0 | 50.0 | 10.0 | 20% | 5.0 | 10% | 1.0 " \
           "| 60%: not |" in md
    assert "q4 B=32 **2.00x**" in md
