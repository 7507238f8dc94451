"""Prometheus metrics of the HTTP front door (`GET /metrics`, text format).

Counters and histograms are fed as requests finish (from each typed output, so the
timings are the front door's, not the HTTP client's); gauges are read from the scheduler's
`stats` at scrape time, so they are exact whenever Prometheus looks. vLLM's names for the
gauges an endpoint picker reads are beside them (`vllm_metrics`).

Tenant names, what each tenant uses, and the pool-wide pinned total are the operator's
(`render(..., operator=True)`): they are kept in a registry of their own, which a tenant's
scrape does not include (a tenant must not learn who else is served, or how much)."""

from __future__ import annotations

import time
from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from radixserve.results.generate import GenerateOutput
from radixserve.server.http.vllm_metrics import VllmMetrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5)

# scheduler stats key -> (gauge name, help)
_GAUGES = {
    "cache_hit_rate": ("cache_hit_rate", "Share of prompt tokens served from the radix cache"),
    "pool_usage": ("kv_pool_usage", "Share of KV blocks not free (cached or in use)"),
    "running": ("num_running_requests", "Requests in the running batch"),
    "waiting": ("num_waiting_requests", "Requests in the waiting queue"),
    "free_blocks": ("kv_free_blocks", "KV blocks on the free list"),
    "evictable_blocks": ("kv_evictable_blocks", "Cached KV blocks no request holds"),
    "locked_blocks": ("kv_locked_blocks", "Cached KV blocks held by running requests"),
    "num_blocks": ("kv_blocks", "KV blocks in the pool"),
    "cascade_steps": ("cascade_steps", "Steps in which tree attention read a shared prefix "
                                       "once for several sequences"),
    "cascade_shared_runs": ("cascade_shared_runs", "Shared block runs read once per group"),
    "graph_steps": ("cuda_graph_steps", "Decode steps replayed as a CUDA graph"),
    "eager_steps": ("eager_steps", "Steps run eagerly with CUDA-graph decode on (prefill, "
                                   "drafts, tree attention, or wider than the graphs)"),
    "lora_adapters": ("lora_adapters_loaded", "LoRA adapters loaded"),
    "lora_slot_fills": ("lora_slot_fills", "LoRA adapters loaded into a device slot"),
    "copied_blocks": ("kv_copied_blocks", "KV blocks copied on write (forked samples, beams)"),
    "forked_samples": ("forked_samples", "Parallel samples forked from a computed prompt"),
    "retractions": ("retractions", "Running requests retracted for memory"),
    "slow_steps": ("scheduler_slow_steps", "Scheduler steps longer than "
                                           "scheduler_stall_seconds (the server's health "
                                           "said stalled while each ran)"),
    "longest_step_seconds": ("scheduler_longest_step_seconds", "The longest scheduler step "
                                                               "so far, in seconds"),
    "spec_steps": ("spec_verify_steps", "Sequence-steps that verified a speculative draft"),
    "spec_draft_tokens": ("spec_draft_tokens", "Speculative draft tokens verified"),
    "spec_accepted_tokens": ("spec_accepted_tokens", "Speculative draft tokens accepted"),
    "spec_acceptance_rate": ("spec_acceptance_rate", "Share of speculative draft tokens "
                                                     "accepted"),
    "spec_break_even": ("spec_break_even", "Chance of acceptance a draft row had to beat in "
                                           "the last step (its cost in tokens)"),
    "kv_mappings": ("kv_mappings", "View mappings the virtual KV layout's views hold, each "
                                   "one memory mapping (VMA) per region of the views (0 "
                                   "without one)"),
    "kv_mapping_budget": ("kv_mapping_budget", "View mappings the virtual KV layout's "
                                               "views may hold (0 without a limit)"),
}


class Metrics:
    """One registry per app, so several servers in one process (tests) do not collide, and
    one more for the operator's series."""

    def __init__(self, max_lora: int | None = None) -> None:
        """`max_lora`: adapters one batch may hold, None without LoRA serving (vLLM's
        `vllm:lora_requests_info` says it)."""
        self.registry = CollectorRegistry()
        self.operator_registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("radixserve_requests", "Generate requests finished",
                                ["endpoint", "finish_reason"], registry=r)
        self.errors = Counter("radixserve_request_errors", "Requests answered with an error",
                              ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("radixserve_prompt_tokens", "Prompt tokens processed",
                                     registry=r)
        self.cached_tokens = Counter("radixserve_cached_prompt_tokens",
                                     "Prompt tokens served from the radix cache", registry=r)
        self.tier_cached_tokens = Counter("radixserve_cache_hit_tokens",
                                          "Prompt tokens served from the radix cache, by the "
                                          "tier that held them", ["tier"], registry=r)
        self.generation_tokens = Counter("radixserve_generation_tokens", "Tokens generated",
                                         registry=r)
        self.ttft = Histogram("radixserve_time_to_first_token_seconds",
                              "Time from arrival to the first output token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("radixserve_inter_token_latency_seconds",
                             "Time between consecutive output tokens of a request",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("radixserve_e2e_request_latency_seconds",
                             "Time from arrival to the last token", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.gauges = {key: Gauge(f"radixserve_{name}", text, registry=r)
                       for key, (name, text) in _GAUGES.items()}
        self.up = Gauge("radixserve_up", "1 when the scheduler and worker answer", registry=r)
        self.vllm = VllmMetrics(r, max_lora)
        # Per tenant (the label values are the configured tenants: bounded). The operator's.
        r = self.operator_registry
        self.pinned_tokens = Gauge("radixserve_kv_pinned_tokens", "Tokens that pinned "
                                   "prefixes keep in memory (every tenant's)", registry=r)
        self.tenant_requests = Counter("radixserve_tenant_requests", "Generate requests "
                                       "finished, by tenant", ["tenant"], registry=r)
        self.tenant_prompt_tokens = Counter("radixserve_tenant_prompt_tokens",
                                            "Prompt tokens processed, by tenant", ["tenant"],
                                            registry=r)
        self.tenant_cached_tokens = Counter("radixserve_tenant_cached_prompt_tokens",
                                            "Prompt tokens served from the tenant's own radix "
                                            "cache namespaces", ["tenant"], registry=r)
        self.tenant_generation_tokens = Counter("radixserve_tenant_generation_tokens",
                                                "Tokens generated, by tenant", ["tenant"],
                                                registry=r)

    def finished(self, endpoint: str, results: Iterable[GenerateOutput],
                 itl_observed: bool = False, tenant: str = "default") -> None:
        """Count finished outputs (of `tenant`'s requests). Unless the caller timed its
        stream's tokens itself (`itl_observed`), each request's mean inter-token gap stands
        for its tokens."""
        for result in results:
            reason = result.finish_reason.type if result.finish_reason else "unknown"
            self.requests.labels(endpoint, reason).inc()
            completion = result.completion_tokens
            prompt, cached = result.prompt_tokens, result.cached_tokens
            self.prompt_tokens.inc(prompt)
            self.cached_tokens.inc(cached)
            tiers = result.cached_tokens_details
            self.tier_cached_tokens.labels("memory").inc(tiers.memory)
            self.tier_cached_tokens.labels("disk").inc(tiers.disk)
            self.generation_tokens.inc(completion)
            self.tenant_requests.labels(tenant).inc()
            self.tenant_prompt_tokens.labels(tenant).inc(prompt)
            self.tenant_cached_tokens.labels(tenant).inc(cached)
            self.tenant_generation_tokens.labels(tenant).inc(completion)
            ttft, e2e = result.ttft, result.e2e_latency
            if ttft is not None:
                self.ttft.observe(ttft)
            if e2e is not None:
                self.e2e.observe(e2e)
                if not itl_observed and ttft is not None and completion > 1:
                    gap = (e2e - ttft) / (completion - 1)
                    for _ in range(completion - 1):
                        self.itl.observe(gap)

    def render(self, stats: dict[str, Any] | None, operator: bool = False) -> bytes:
        """The scrape: the server's series, and for the `operator` its own as well."""
        self.up.set(1 if stats is not None else 0)
        for key, gauge in self.gauges.items():
            if stats is not None and key in stats:
                gauge.set(stats[key])
        if stats is not None:
            self.vllm.update(stats, time.time())
        if not operator:
            return generate_latest(self.registry)
        if stats is not None and "pinned_tokens" in stats:
            self.pinned_tokens.set(stats["pinned_tokens"])
        return generate_latest(self.registry) + generate_latest(self.operator_registry)


class StreamTimer:
    """Inter-token gaps of one stream as its chunks arrive (a chunk may carry several
    tokens: its gap is spread over them)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.last: dict[int, float] = {}

    def chunk(self, index: int, n_tokens: int, now: float) -> None:
        before = self.last.get(index)
        self.last[index] = now
        if before is not None and n_tokens > 0:
            gap = (now - before) / n_tokens
            for _ in range(n_tokens):
                self.metrics.itl.observe(gap)
