"""Growing or retracting the running batch, the step's first phase: which running sequences
compute in this step and how many tokens each, then what admission adds.

The contract:

- **Decodes first.** Each running sequence with one token to compute gets a block for it;
  when the pool cannot cover them all, the newest running sequence (with tenant shares, the
  newest of the tenant holding the most KV) is retracted (its prefix stays cached) until it
  can: a held prefix (a disk load's) goes before any request, and
  with a step in flight nothing is retracted (its fold may free what is short: the decodes
  that do not fit wait a step instead).
- **Then drafts** (the features' `draft` hooks), **then prefill chunks** of the running
  prompts, **then admissions** (scheduler/admission.py), all within `chunked_prefill_size`
  tokens (with tenant shares, a tenant's prompts within its part of a step that decodes
  another tenant's: scheduler/shares.py).
- **Never stuck.** When nothing at all could run for memory (every running request stuck
  mid-prefill, a beam waiting for its siblings, the queue's head not fitting beside the
  prefixes held for the others), a held prefix is dropped, else the newest running request
  is retracted, and the batch is planned again.
- **Retraction is decided here alone**, for memory or for a feature's `preempt` hook (a
  tenant under its share waiting); `Finishing.retract` carries it out.
"""

from __future__ import annotations

from radixserve.scheduler.admission import Admission
from radixserve.scheduler.batch import ScheduledSeq, plan_seq
from radixserve.scheduler.cache_service import CacheService
from radixserve.scheduler.features import StepHooks
from radixserve.scheduler.finish import Finishing
from radixserve.scheduler.mappings import MappingAccount
from radixserve.scheduler.request import Req
from radixserve.scheduler.state import SchedulerState


class RunningBatch:
    def __init__(self, state: SchedulerState, cache: CacheService, hooks: StepHooks,
                 finishing: Finishing, admission: Admission,
                 maps: MappingAccount | None) -> None:
        """`maps`: the virtual layout's account of view mappings (None: a layout without)."""
        self.state, self.cache, self.hooks = state, cache, hooks
        self.finishing, self.admission, self.maps = finishing, admission, maps

    def plan(self) -> list[ScheduledSeq]:
        """The step's sequences (none when nothing can run, or nothing is there to run)."""
        state, kv = self.state, self.cache.kv
        seqs: list[ScheduledSeq] = []
        while not seqs and (state.running or state.waiting):
            seqs = self._pick()
            if seqs or kv.disk_loads.asked or state.in_flight:
                break  # (a load or a step in flight may bring what is short)
            if kv.disk_loads.held:
                kv.disk_loads.drop_holds()  # costs only a load to bring back
            elif state.running:
                self.finishing.retract(self._memory_victim())
            else:
                break
        return seqs

    def _memory_victim(self) -> Req:
        """Who is retracted when memory runs short: the newest running request, or with
        tenant shares the newest of the tenant holding the most KV."""
        running, shares = self.state.running, self.admission.shares
        return running[-1] if shares is None else shares.memory_victim(running)

    def _pick(self) -> list[ScheduledSeq]:
        state, kv = self.state, self.cache.kv
        running = state.running
        for preempt in self.hooks.preempt:
            if (victim := preempt(state.waiting, running)) is not None:
                self.finishing.retract(victim)
        budget = state.config.chunked_prefill_size
        seqs = []
        for req in self._decodes():
            kv.grow(req.kv, 1)
            seqs.append(plan_seq(req, 1))
        budget -= len(seqs)
        for draft in self.hooks.draft:
            budget -= draft(seqs, budget, running)
        maps = self.maps
        shares = self.admission.shares
        caps = shares.prefill_caps(seqs, state.waiting) if shares is not None else None
        for req in running:
            n = min(req.to_compute, budget)
            if caps is not None and req.to_compute > 1:
                n = caps.allows(req.group.tenant, n)
            if req.to_compute > 1 and n > 0 and (not maps or maps.grows(
                    running, req, kv.blocks_for([req.kv], n))):
                n = kv.grow(req.kv, n)
                if n:
                    seqs.append(plan_seq(req, n))
                    budget -= n
                    if caps is not None:
                        caps.take(req.group.tenant, n)
        if budget > 0:
            seqs.extend(self.admission.admit(budget, state.new_token_ratio, caps))
        return seqs

    def _decodes(self) -> list:
        """The running sequences that decode this step, retracting for their blocks."""
        state, kv, maps = self.state, self.cache.kv, self.maps
        decodes = [r for r in state.running if r.to_compute == 1]
        while ((need := kv.blocks_for([r.kv for r in decodes], 1)) > kv.available_blocks
               or maps and not maps.fits(state.running, need)):  # one more mapping
            if kv.disk_loads.held and need > kv.available_blocks:
                kv.disk_loads.drop_holds()
            elif state.in_flight:
                decodes.pop()  # (so no step in flight is lost to a retraction)
            else:
                self.finishing.retract(victim := self._memory_victim())
                if victim in decodes:
                    decodes.remove(victim)
        return decodes
