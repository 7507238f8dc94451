"""Admission: which waiting requests join the running batch this step, and how much of
their prompt runs in it.

Waiting requests are taken in the policy's order (scheduler/policy.py), with tenant shares
on tenants in turn and each kept to its share of the batch (scheduler/shares.py), while the
step's token budget and `max_running_requests` allow, and a LoRA adapter's request once its
adapter has a device slot (scheduler/loras.py). Each is matched against the tree first (its
cached prefix costs nothing), may wait for a prefix another running request is about to
compute, or for its prefix to come back from the disk tier; it is admitted only when the
memory left covers what the running requests are expected to add (`future_tokens`, a
share of their remaining `max_new_tokens`) besides its own chunk; with tenant shares, what
another tenant's requests expect counts only up to that tenant's share of the pool, so
one request's `n` x `max_new_tokens` cannot keep the others out of a mostly free pool.
Plain class: it changes the scheduler's queues, which it is handed, and the cache, and
nothing else.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING

from radixserve.config import EngineConfig
from radixserve.scheduler.batch import ScheduledSeq, plan_seq
from radixserve.scheduler.cache_service import CacheService
from radixserve.scheduler.loras import LoraRegistry
from radixserve.scheduler.mappings import MappingAccount
from radixserve.scheduler.policy import order_waiting, waits_for_shared_prefix
from radixserve.scheduler.request import Req, Status
from radixserve.scheduler.state import SchedulerState

if TYPE_CHECKING:
    from radixserve.scheduler.shares import PrefillCaps, TenantShares


def future_tokens(req: Req, config: EngineConfig, new_token_ratio: float) -> int:
    """The estimate of the tokens `req` (and what it forks into) will add after the prompt:
    `new_token_ratio` of its remaining `max_new_tokens` (clipped to
    `admission_max_new_tokens`), for each sequence it stands for."""
    clipped = min(req.remaining_new_tokens, config.admission_max_new_tokens)
    return math.ceil(clipped * new_token_ratio) * req.group.queued_width


class Admission:
    def __init__(self, config: EngineConfig, cache: CacheService, maps: MappingAccount | None,
                 loras: LoraRegistry, state: SchedulerState) -> None:
        """`state`: the scheduler's queues (moved between in place)."""
        self.config, self.cache, self.maps, self.loras = config, cache, maps, loras
        self.waiting, self.running = state.waiting, state.running
        self.shares: TenantShares | None = None
        """Tenant shares, once on (a single tenant has the whole batch)."""
        self.disk = cache.radix_cache.disk is not None
        self.pool_tokens = cache.allocator.num_blocks * cache.page_size
        self.prompt_tokens = 0
        """Prompt tokens of the requests admitted (each request once)."""
        self.prompt_cached_tokens = 0
        """Of them, those the cache held at admission."""

    def admit(self, budget: int, ratio: float,
              caps: PrefillCaps | None = None) -> list[ScheduledSeq]:
        """Admit waiting requests into `budget` tokens of the step, reserving `ratio` of
        the running requests' remaining tokens, each tenant's prompts within `caps` (tenant
        shares'); returns their first chunks."""
        seqs = []
        kv, tree = self.cache.kv, self.cache.radix_cache
        config, running = self.config, self.running
        shares = self.shares
        reserved = width_running = 0
        computing = []  # running prompts: a waiting request may wait for their prefixes
        reserves: Counter[str] = Counter()  # by tenant, with shares on
        for r in running:
            need = r.to_compute + future_tokens(r, config, ratio)
            reserved += need
            if shares is not None:
                reserves[r.group.tenant] += need
            # Sequences, as max_running_requests counts them: a running prompt's samples
            # still to fork run from its next step on (the virtual layout has a view each).
            width_running += r.group.queued_width
            if r.kv.kv_len < len(r.input_ids):
                computing.append(r)
        waiting = self.waiting  # one alone has no order to find
        ordered = (order_waiting(config.schedule_policy, waiting, tree) if len(waiting) > 1
                   else list(waiting))
        if shares is not None:
            widths = shares.running_by_tenant(running)
            share = shares.running_share(self.waiting, running)
            memory_share = shares.memory_share(self.waiting, running, self.pool_tokens)
            held = shares.held_by_tenant(running)
            ordered = shares.interleave(ordered, widths)
        draining = None if shares is None else shares.draining(self.waiting, running)
        for req in ordered:
            width = req.group.queued_width
            if budget <= 0 or width_running + width > config.max_running_requests:
                break
            if shares is not None and shares.over_share(req.group.tenant, width, widths, share):
                continue  # its tenant has its share running: the others' turn
            h = req.kv
            if req in req.group.candidates:
                continue  # a beam retracted with its step done waits for its siblings
            if h.loading is not None and h.loading.pending:
                continue  # its prefix comes back from disk with the next step: not computed
            if computing and tree.enabled and waits_for_shared_prefix(req, computing, tree):
                continue
            if req.lora is not None and req.lora == draining:
                continue  # its slot is being freed for another tenant's adapter
            if req.lora is not None and self.loras.claim_slot(
                    req.lora, (r.lora for r in running)) is None:
                continue  # every slot runs another adapter: it waits for one
            tokens, limit = req.tokens(0, req.seq_len), req.prefix_limit
            kv.attach_prefix(h, tokens, limit)
            if h.loading is not None:
                kv.disk_loads.drop_hold(h)  # attached: its own lock keeps the loaded prefix now
            future = future_tokens(req, config, ratio)
            room = kv.available_blocks * self.cache.page_size
            others = reserved if shares is None else shares.counted_reserve(
                reserves, held, req.group.tenant, memory_share)
            if self.disk and kv.start_load(h, tokens, limit,
                                           room - others - future if running else None):
                continue
            need = req.to_compute + future
            n = 0
            chunk = min(req.to_compute, budget)
            if caps is not None:
                chunk = caps.allows(req.group.tenant, chunk)
            if chunk and (need + others <= room or not running):
                n = kv.grow(h, chunk)
            if n == 0 or self.maps and not self.maps.admits(running, req):  # views' mappings
                kv.release(h)
                if chunk == 0:
                    continue  # its tenant's part of the step is taken: the others' turn
                break
            if not req.admitted:  # counted once, however often admission was tried
                req.admitted, h.cached_tokens = True, h.kv_len
                self.prompt_tokens += len(req.input_ids)
                self.prompt_cached_tokens += h.kv_len
                assert h.node is not None  # (attached)
                tree.record_lookup(h.node, h.kv_len, len(req.input_ids),
                                   disk_hit=min(h.disk_tokens, h.kv_len))
            self.waiting.remove(req)
            running.append(req)
            width_running += width
            if shares is not None:
                widths[req.group.tenant] += width
                reserves[req.group.tenant] += need
            if caps is not None:
                caps.take(req.group.tenant, n)
            req.status = Status.RUNNING
            seqs.append(plan_seq(req, n))
            computing.append(req)
            budget -= n
            reserved += need
        return seqs

    def stats(self) -> dict[str, int | float]:
        return {"prompt_tokens": self.prompt_tokens,
                "prompt_cached_tokens": self.prompt_cached_tokens,
                "cache_hit_rate": self.prompt_cached_tokens / max(self.prompt_tokens, 1)}
