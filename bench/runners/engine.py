"""radixserve's in-process `Engine`, with the prefix cache on or off.

Each wave is one `Engine.generate` call with all of the wave's prompts: they share one
continuous batch, so the engine's own scheduler decides admission, chunking and order.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.runners.base import GREEDY, Completion, Runner
from bench.workloads import Request, Workload

COUNTERS = ("steps", "prefill_tokens", "decode_tokens", "retractions", "prompt_tokens",
            "prompt_cached_tokens", "evicted_tokens")


class EngineRunner(Runner):
    def __init__(self, model_dir: Path, cache: bool = True, **engine_options: Any) -> None:
        self.model_dir, self.cache = model_dir, cache
        self.options = dict(engine_options)
        self.name = "radixserve" if cache else "radixserve-nocache"
        self.engine: Any = None
        self._before: dict[str, int] = {}

    def settings(self) -> dict[str, Any]:
        return {"enable_prefix_cache": self.cache, **self.options}

    def open(self) -> None:
        from radixserve import Engine

        self.engine = Engine(str(self.model_dir), enable_prefix_cache=self.cache, **self.options)
        self.engine.generate(input_ids=list(range(100, 140)),
                             sampling_params={"max_new_tokens": 4, **GREEDY})
        self.engine.flush_cache()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    def begin(self, workload: Workload) -> None:
        self.engine.flush_cache()
        stats = self.engine.stats()
        self._before = {k: stats[k] for k in COUNTERS}

    def info(self) -> dict[str, Any]:
        stats = self.engine.stats()
        delta = {k: stats[k] - self._before.get(k, 0) for k in COUNTERS}
        delta["engine_cache_hit_rate"] = (delta["prompt_cached_tokens"]
                                          / max(delta["prompt_tokens"], 1))
        delta.update(num_blocks=stats["num_blocks"], page_size=stats["page_size"],
                     kv_pool_mb=stats["kv_pool_bytes"] / 2 ** 20)
        return delta

    def generate(self, prompts: list[list[int]], requests: list[Request]) -> list[Completion]:
        params = [{"max_new_tokens": r.output_tokens, **GREEDY} for r in requests]
        submitted = time.perf_counter()
        results = self.engine.generate(input_ids=prompts, sampling_params=params)
        out = []
        for res in results:
            meta = res["meta_info"]
            out.append(Completion(res["output_ids"], meta["cached_tokens"], submitted,
                                  submitted + meta["ttft"], submitted + meta["e2e_latency"]))
        return out
