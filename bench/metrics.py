"""Metrics over per-request records: pure functions, no clocks, no model.

Times in a `RequestRecord` are seconds since the start of the run. Definitions:

- TTFT = first_token - submit; E2E = finish - submit;
- TPOT (time per output token after the first) = (finish - first_token) / (output - 1),
  only for requests with at least 2 output tokens;
- wall = last finish - first submit; throughputs divide token counts by the wall;
- cache hit rate = prompt tokens served from a cache / prompt tokens (for the transformers
  prefix-reuse runner, the reused prefix counts as served from its cache);
- percentiles interpolate linearly between closest ranks (numpy's default).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence


@dataclass(frozen=True)
class RequestRecord:
    rid: str
    group: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    submit_s: float
    first_token_s: float
    finish_s: float

    @property
    def ttft(self) -> float:
        return self.first_token_s - self.submit_s

    @property
    def e2e(self) -> float:
        return self.finish_s - self.submit_s

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; NaN for no values."""
    xs = sorted(values)
    if not xs:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside [0, 100]")
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def wall_seconds(records: Sequence[RequestRecord]) -> float:
    return max(r.finish_s for r in records) - min(r.submit_s for r in records)


def cache_hit_rate(records: Sequence[RequestRecord]) -> float:
    prompt = sum(r.prompt_tokens for r in records)
    return sum(r.cached_tokens for r in records) / prompt if prompt else 0.0


def summarize(records: Sequence[RequestRecord]) -> dict[str, float]:
    """The headline numbers of one run (one runner on one workload)."""
    if not records:
        raise ValueError("no records to summarize")
    wall = wall_seconds(records)
    prompt = sum(r.prompt_tokens for r in records)
    output = sum(r.output_tokens for r in records)
    ttfts = [r.ttft for r in records]
    tpots = [t for r in records if (t := r.tpot) is not None]
    return {
        "requests": len(records),
        "prompt_tokens": prompt,
        "cached_tokens": sum(r.cached_tokens for r in records),
        "output_tokens": output,
        "wall_s": wall,
        "output_tok_s": output / wall,
        "total_tok_s": (prompt + output) / wall,
        "requests_s": len(records) / wall,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "tpot_p50_s": percentile(tpots, 50),
        "tpot_p99_s": percentile(tpots, 99),
        "e2e_p50_s": percentile((r.e2e for r in records), 50),
        "cache_hit_rate": cache_hit_rate(records),
    }


def hit_rate_over_time(records: Sequence[RequestRecord]) -> list[tuple[float, float]]:
    """Cumulative cache hit rate after each request's prefill, as (time s, rate) points in
    the order of first tokens (a request's prefix was looked up by then)."""
    points, prompt, cached = [], 0, 0
    for r in sorted(records, key=lambda r: (r.first_token_s, r.rid)):
        prompt += r.prompt_tokens
        cached += r.cached_tokens
        points.append((r.first_token_s, cached / prompt if prompt else 0.0))
    return points


def agreement(outputs: dict[str, list[int]], reference: dict[str, list[int]]) -> float:
    """Share of requests (present in both) whose output ids equal the reference's."""
    common = [rid for rid in outputs if rid in reference]
    if not common:
        return math.nan
    return sum(outputs[rid] == reference[rid] for rid in common) / len(common)
