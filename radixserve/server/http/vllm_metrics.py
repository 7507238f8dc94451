"""vLLM's metric names beside radixserve's, with vLLM's meanings: what the Gateway API
Inference Extension's model-server protocol (and llm-d's endpoint picker) scrape to choose a
replica. Read from the scheduler's `stats` at scrape time, as radixserve's own gauges are.

- `vllm:num_requests_waiting`, `vllm:num_requests_running`: sequences queued and in the
  running batch (radixserve's `waiting` and `running`).
- `vllm:kv_cache_usage_perc`: the share (0 to 1) of KV blocks a request holds. vLLM counts
  a cached block no request holds as free (its prefix cache evicts it on demand), so the
  radix cache's evictable blocks count as free here too; radixserve's own
  `radixserve_kv_pool_usage` counts them as used.
- `vllm:lora_requests_info` (with LoRA serving only): one series whose value is the scrape's
  time and whose labels are `max_lora` (adapters one batch may hold), and the adapters of
  the running and the waiting requests, comma-separated. Each scrape replaces the series
  (vLLM's keeps the old ones, which the picker ignores by their older time). The adapters
  in use are every tenant's: the series is the operator's scrape's only (a picker scrapes
  with the operator's key where the server has tenants)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Gauge

LORA_LABELS = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")


class VllmMetrics:
    """The series, in `registry`; `max_lora` None: LoRA serving is off (no LoRA series)."""

    def __init__(self, registry: CollectorRegistry, max_lora: int | None) -> None:
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be processed",
                             registry=registry)
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch",
                             registry=registry)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 "
                              "percent (blocks requests hold)", registry=registry)
        self.max_lora = max_lora
        self.lora = None if max_lora is None else Gauge(
            "vllm:lora_requests_info", "Running stats on LoRA requests", LORA_LABELS,
            registry=registry)

    def update(self, stats: dict[str, Any], now: float) -> None:
        """Set from the scheduler's `stats` (`now`: the scrape's time, the LoRA series'
        value); a series whose stats are missing (a router's) keeps its value."""
        if "waiting" in stats:
            self.waiting.set(stats["waiting"])
            self.running.set(stats["running"])
        if stats.get("num_blocks"):
            held = stats["num_blocks"] - stats["free_blocks"] - stats["evictable_blocks"]
            self.kv_usage.set(held / stats["num_blocks"])
        if self.lora is not None:
            self.lora.clear()
            if "lora_running" in stats:  # the operator's stats: which adapters are in use
                self.lora.labels(str(self.max_lora), ",".join(stats["lora_running"]),
                                 ",".join(stats["lora_waiting"])).set(now)
