"""Fair shares between tenants (issue 41): how much of the queue and of the running batch
one tenant may hold, and the order in which tenants' waiting requests are offered places.

- **Queue**: a tenant's waiting outputs (samples and beams count) are bounded by
  `max_queued_requests_per_tenant`; a request past it is refused `overloaded`, naming that
  limit, and the other tenants' room in the queue (`max_queued_requests`) is untouched.
- **Running**: a tenant's running sequences are bounded by its share,
  `max_running_requests_per_tenant`, or by default an equal part of `max_running_requests`
  among the tenants that have requests running or waiting. A tenant alone has the whole
  batch, so a single-tenant server pays nothing; a request wider than the share (a large
  `n`) still runs once its tenant has nothing else running.
- **Order**: admission offers places tenant by tenant in turn (round robin, the tenant with
  the fewest running sequences first), each tenant's requests in the policy's order, rather
  than first come first served across tenants.
- **Memory**: admission leaves room for what another tenant's running requests are
  expected to add only up to what that tenant's share of the KV pool leaves beside what
  it holds (`counted_reserve`); when memory runs short, the newest request of the tenant
  holding the most KV is retracted (`memory_victim`), not whichever request came last;
  and a waiting request of a tenant under its share that does not fit has one request of
  the tenant holding the most retracted per step, while that tenant is over its share
  (`memory_preempt`).
- **Prefill**: in a step that decodes another tenant's sequences, or while another tenant
  has requests waiting, a tenant's prompts (its running prompts' chunks and its admissions
  together) take at most `tenant_prefill_tokens`, so a flood of long prompts adds at most
  that much prefill to the other tenants' time between tokens, and leaves the step's
  budget to admit their requests (a newcomer waits for the step in flight, not for the
  flood's chunks); with nobody else decoding or waiting it has the whole budget.
- **LoRA slots**: when every adapter slot (`max_loras_per_batch`) runs an adapter and a
  tenant's adapter waits for one, a tenant holding more than an equal part of the slots
  has one running request retracted per step, from its least used adapter, until that
  slot frees (`slot_victim`).
- **Preemption**: when the batch is full and a tenant under its share waits, one running
  request of the tenant furthest over its share is retracted per step (its computed prefix
  stays cached), so a tenant that filled the batch before the others came cannot keep them
  out until its requests end.

The queue's share is `check_queue_share`, which the scheduler asks only when the whole
queue is past a tenant's share of it (so a short queue, or one tenant's within its share,
costs nothing of this). The rest is a step feature (scheduler/features.py),
`TenantShares` (running, order, preemption), on from the start when
`max_running_requests_per_tenant` is set, else from the first request of a second tenant
(one tenant alone has no share to keep), which acts in each step.
"""

from __future__ import annotations

import math
from collections import Counter
from itertools import chain, zip_longest
from typing import TYPE_CHECKING

from radixserve.config import EngineConfig
from radixserve.scheduler.features import OverloadedError, StepFeature
from radixserve.scheduler.request import Req, SeqGroup

if TYPE_CHECKING:
    from radixserve.scheduler.batch import ScheduledSeq
    from radixserve.scheduler.kv import KVManager
    from radixserve.scheduler.loras import LoraRegistry


def check_queue_share(config: EngineConfig, waiting: list[Req], group: SeqGroup) -> None:
    """Refuse (OverloadedError) a new request (its `group`, not queued yet) that would take
    its tenant past `max_queued_requests_per_tenant` of the queue (`waiting`)."""
    tenant, outputs, most = group.tenant, group.queued_width, config.max_queued_requests_per_tenant
    queued = sum([r.group.queued_width for r in waiting if r.group.tenant == tenant])
    if queued + outputs > most:
        raise OverloadedError(
            f"server overloaded: this tenant has {queued} requests waiting and asked for "
            f"{outputs} more (max_queued_requests_per_tenant={most})")


class PrefillCaps:
    """The prompt tokens each tenant may still prefill in one step (`TenantShares.
    prefill_caps`): `tokens` for a tenant while another tenant decodes in the step or
    waits."""

    def __init__(self, pressing: set[str], tokens: int) -> None:
        self.pressing, self.tokens = pressing, tokens
        self.taken: Counter[str] = Counter()

    def allows(self, tenant: str, n: int) -> int:
        """How many of `n` prompt tokens `tenant` may prefill now."""
        if not self.pressing - {tenant}:
            return n
        return max(0, min(n, self.tokens - self.taken[tenant]))

    def take(self, tenant: str, n: int) -> None:
        self.taken[tenant] += n


class TenantShares(StepFeature):
    """Its hook: `preempt`; admission asks it the rest."""

    def __init__(self, config: EngineConfig, kv: KVManager | None = None,
                 loras: LoraRegistry | None = None) -> None:
        """`kv`: the pool, whose memory is shared out; `loras`: the adapters' device slots,
        shared out too while LoRA serving is on."""
        self.kv = kv
        self.loras = loras if loras is not None and loras.enabled else None
        self.max_running = config.max_running_requests_per_tenant
        self.total_running = config.max_running_requests
        self.prefill_tokens = config.tenant_prefill_tokens

    @staticmethod
    def running_by_tenant(running: list[Req]) -> Counter[str]:
        """The sequences each tenant has running (a prompt's samples still to fork count)."""
        widths: Counter[str] = Counter()
        for r in running:
            widths[r.group.tenant] += r.group.queued_width
        return widths

    def running_share(self, waiting: list[Req], running: list[Req]) -> int:
        """The sequences one tenant may have running now."""
        if self.max_running:
            return self.max_running
        active = {r.group.tenant for r in chain(waiting, running)}
        return math.ceil(self.total_running / max(len(active), 1))

    @staticmethod
    def memory_share(waiting: list[Req], running: list[Req], pool_tokens: int) -> int:
        """The KV tokens one tenant's expected growth may claim when admission weighs
        another's request: an equal part of the pool among the active tenants."""
        active = {r.group.tenant for r in chain(waiting, running)}
        return pool_tokens // max(len(active), 1)

    @staticmethod
    def held_by_tenant(running: list[Req]) -> Counter[str]:
        """The KV tokens each tenant's running requests hold."""
        held: Counter[str] = Counter()
        for r in running:
            held[r.group.tenant] += r.kv.kv_len
        return held

    @staticmethod
    def counted_reserve(reserves: Counter[str], held: Counter[str], tenant: str,
                        memory_share: int) -> int:
        """The tokens the running requests are expected to add, as a request of `tenant`
        must leave room for them: its own tenant's in full, each other tenant's up to what
        `memory_share` leaves beside what it holds. What a tenant expects beyond its share
        is not kept free for it: if its requests do grow into it, the memory that runs
        short is retracted from the tenant holding the most (`memory_victim`)."""
        return sum(need if t == tenant else min(need, max(0, memory_share - held[t]))
                   for t, need in reserves.items())

    @classmethod
    def memory_victim(cls, running: list[Req]) -> Req:
        """The running request to retract when memory runs short: the newest of the
        tenant whose running requests hold the most KV."""
        held = cls.held_by_tenant(running)
        tenant = max(held, key=held.__getitem__)
        return next(r for r in reversed(running) if r.group.tenant == tenant)

    def memory_preempt(self, waiting: list[Req], running: list[Req]) -> Req | None:
        """The running request to retract so that a waiting tenant under its share of the
        pool gets memory: when the first waiting request of such a tenant does not fit in
        what is free, the newest of the tenant holding the most, if that is over its share.
        None when nobody under its share waits for memory."""
        if self.kv is None:
            return None
        held = self.held_by_tenant(running)
        share = self.memory_share(waiting, running,
                                  self.kv.allocator.num_blocks * self.kv.page_size)
        room = self.kv.available_blocks * self.kv.page_size
        short = any(held[r.group.tenant] < share and r.to_compute > room for r in waiting)
        if not short or not held:
            return None
        tenant, most = held.most_common(1)[0]
        if most <= share:
            return None
        return next(r for r in reversed(running) if r.group.tenant == tenant)

    def prefill_caps(self, decodes: list[ScheduledSeq], waiting: list[Req]
                     ) -> PrefillCaps | None:
        """What each tenant's prefill may take of a step that decodes `decodes` while
        `waiting` wait: at most `tenant_prefill_tokens` for a tenant while another tenant's
        sequences decode in it or wait, else the step's whole budget (None: nobody decodes
        or waits, nothing to keep)."""
        pressing = {s.req.group.tenant for s in decodes} | {r.group.tenant for r in waiting}
        return PrefillCaps(pressing, self.prefill_tokens) if pressing else None

    def over_share(self, tenant: str, width: int, widths: Counter[str], share: int) -> bool:
        """Whether admitting `width` more sequences of `tenant` would pass its share (a
        tenant with nothing running may always start one request, however wide)."""
        return widths[tenant] > 0 and widths[tenant] + width > share

    def interleave(self, ordered: list[Req], widths: Counter[str]) -> list[Req]:
        """`ordered` (the policy's order) taken one tenant at a time in turn, the tenants
        with the fewest running sequences first; each tenant's requests keep their order."""
        by_tenant: dict[str, list[Req]] = {}
        for r in ordered:
            by_tenant.setdefault(r.group.tenant, []).append(r)
        if len(by_tenant) < 2:
            return ordered
        turns = sorted(by_tenant.values(), key=lambda reqs: widths[reqs[0].group.tenant])
        return [r for row in zip_longest(*turns) for r in row if r is not None]

    def preempt(self, waiting: list[Req], running: list[Req]) -> Req | None:
        """The running request to retract so that a waiting tenant under its share gets a
        place in a full batch (`batch_victim`), else an adapter slot (`slot_victim`), else
        memory (`memory_preempt`)."""
        victim = self.batch_victim(waiting, running)
        if victim is None and self.loras is not None:
            victim = self.slot_victim(waiting, running, self.loras.slots)
        if victim is None:
            victim = self.memory_preempt(waiting, running)
        return victim

    @staticmethod
    def slot_victim(waiting: list[Req], running: list[Req],
                    slots: list[str | None]) -> Req | None:
        """The running request to retract so that a tenant whose adapter waits for a slot
        gets one: the newest on the adapter whose slot is freed (`slot_to_free`)."""
        name = TenantShares.slot_to_free(waiting, running, slots)
        return None if name is None else next(r for r in reversed(running) if r.lora == name)

    def draining(self, waiting: list[Req], running: list[Req]) -> str | None:
        """The adapter whose slot is being freed (`slot_to_free`), if any: admission does
        not start its retracted requests again, which would keep the slot busy for ever
        when it runs more than one."""
        return None if self.loras is None else self.slot_to_free(waiting, running,
                                                                 self.loras.slots)

    @staticmethod
    def slot_to_free(waiting: list[Req], running: list[Req],
                     slots: list[str | None]) -> str | None:
        """When every slot's adapter is in use and one tenant's requests hold more than an
        equal part of the slots (among the tenants running or wanting adapters) while
        another's adapter waits: that tenant's least used adapter (its slot frees once none
        of its requests runs). None when a slot is free or idle, or nobody is over its
        part."""
        users: dict[str, Counter[str]] = {}
        for r in running:
            if r.lora is not None:
                users.setdefault(r.lora, Counter())[r.group.tenant] += 1
        if any(name is None or name not in users for name in slots):
            return None  # a free or idle slot: the waiting adapter claims it
        wanting = {r.group.tenant for r in waiting if r.lora is not None and r.lora not in slots}
        holders = {name: users[name].most_common(1)[0][0] for name in slots if name}
        held = Counter(holders.values())
        share = math.ceil(len(slots) / max(len(wanting | set(held)), 1))
        if not any(held[t] < share for t in wanting):
            return None
        tenant, most = held.most_common(1)[0]
        if most <= share:
            return None
        return min((n for n, t in holders.items() if t == tenant),
                   key=lambda n: users[n][tenant])

    def batch_victim(self, waiting: list[Req], running: list[Req]) -> Req | None:
        """The running request to retract so that a waiting tenant under its share gets a
        place in a full batch: the newest of the tenant furthest over its share; None when
        the batch has room, nobody under its share waits, or nobody is over it."""
        widths = self.running_by_tenant(running)
        if sum(widths.values()) < self.total_running:
            return None
        share = self.running_share(waiting, running)
        if not any(widths[r.group.tenant] < share for r in waiting):
            return None
        tenant, width = max(widths.items(), key=lambda item: item[1])
        if width <= share:
            return None
        return next(r for r in reversed(running) if r.group.tenant == tenant)
