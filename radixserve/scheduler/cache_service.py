"""The scheduler's one object for every cache matter: the block pool, the radix tree
(`radix_cache`, a RadixCache, with its disk tier and the log of its changes that a router
is told, `EngineCore.take_cache_events`), the KV manager that moves blocks for sequences
(scheduler/kv.py), the pins (scheduler/pins.py) and the disk tier's index.

Pins: a pin of a prefix that is cached whole is answered at once (`pin`). One that is not
runs its prefill request (max_new_tokens 0) like any request, which the scheduler
queues (`pin_after_prefill`); when that finishes, the prefix is pinned in the same call
that inserted it (`prefilled`), so nothing can evict it in between; its answer goes to the
scheduler's outbox, and its own RequestUpdates go to nobody.

The disk tier (`kv_disk_dir`): the tree moves what it evicts to disk and each step sends the
worker what to save, load and delete (`send_transfers`; a step may carry nothing else, when
a load is all there is to do). The index is saved every `kv_persist_interval` seconds
(`maybe_save_index`) and after `close`, which first writes every cached prefix out, so that
a scheduler started on the same directory resumes with the tree as it was, on disk.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from radixserve.cache.allocator import BlockAllocator
from radixserve.cache.block_events import BlockEventLog
from radixserve.cache.disk import DiskTier
from radixserve.cache.events import EventLog
from radixserve.cache.persist import lock_store, open_store, save_index
from radixserve.cache.radix import RadixCache
from radixserve.cache.summary import HEAD_TOKENS
from radixserve.cache.tree import RadixTree
from radixserve.config import EngineConfig
from radixserve.messages.kv_events import MEDIUM_CPU, MEDIUM_GPU
from radixserve.messages import (CacheScope, Caller, Control, ControlReply, ForwardBatch,
                                 PinCall, RequestRejected, TokenizedRequest, UnpinCall,
                                 WorkerInfo)
from radixserve.scheduler.kv import KVManager
from radixserve.scheduler.pins import PinKey, PinnedPrefixes
from radixserve.scheduler.request import Req
from radixserve.speculative.suffix_index import SuffixIndex


class CacheService:
    def __init__(self, config: EngineConfig, info: WorkerInfo,
                 outbox: list[ControlReply | RequestRejected], record_events: bool = False,
                 secret: bytes = b"",
                 adapter_name: Callable[[str], str | None] = lambda fingerprint: None) -> None:
        """`outbox`: the scheduler's, where a pin that waited for its prefill is answered.
        `record_events`: record the tree's changes (`radix_cache.events`), which must then
        be taken after every step (what is not taken accumulates), as vLLM's KV events too
        with `config.kv_events` (named by `adapter_name`, a LoRA adapter's name from its
        fingerprint). `secret` keys the tree's page hashes (tenants.load_cache_secret)."""
        self.config, self.info = config, info
        self.page_size = info.page_size
        self.allocator = BlockAllocator(info.num_blocks)
        disk = None
        if config.kv_disk_dir is not None and config.enable_prefix_cache:
            disk = DiskTier(config.kv_disk_size, info.kv_pool_bytes // info.num_blocks)
        self.index = (SuffixIndex() if config.enable_prefix_cache and config.speculative != "off"
                      else None)
        """What the tree's token sequences say follows a tail (speculative decoding's
        `tree` drafts), fed by the tree itself."""
        events: bool | Callable[[RadixTree], EventLog] = record_events
        if record_events and config.kv_events != "off":
            events = partial(BlockEventLog, medium=MEDIUM_GPU if info.device.startswith("cuda")
                             else MEDIUM_CPU, hashing=config.kv_events,
                             seed=config.kv_events_seed, adapter_name=adapter_name)
        self.radix_cache = RadixCache(self.allocator, self.page_size,
                                      enabled=config.enable_prefix_cache,
                                      record_events=events, disk=disk, hash_key=secret,
                                      token_index=self.index)
        self.kv = KVManager(self.allocator, self.radix_cache, self.page_size,
                            load_cost=info.disk_load_seconds_per_token,
                            prefill_cost=info.prefill_seconds_per_token)
        self.disk_dir = (Path(config.kv_disk_dir)
                         if disk is not None and config.kv_disk_dir is not None else None)
        if self.disk_dir is not None:
            self._disk_lock = lock_store(self.disk_dir)
            open_store(self.disk_dir, self.radix_cache, info.kv_fingerprint, info.vocab_size,
                       info.tp_size)
        self._index_saved_at = time.monotonic()
        self.pins = PinnedPrefixes(self.radix_cache,
                                   config.pin_limit(info.num_blocks * self.page_size))
        self._pinning: dict[str, tuple[Control, PinKey]] = {}
        """Pins waiting for their prefill, by the rid of that prefill."""
        self.outbox = outbox

    # -- each step ----------------------------------------------------------------------
    @property
    def has_transfers(self) -> bool:
        """The disk tier has saves, loads or deletes for the next step."""
        return self.radix_cache.disk is not None and self.radix_cache.disk.has_transfers

    def send_transfers(self, forward: ForwardBatch) -> None:
        """Let the disk tier's transfers ride with `forward`."""
        if self.radix_cache.disk is not None:
            self.radix_cache.disk.send_with(forward)

    def flush(self) -> None:
        """Drop every cached prefix but the pinned ones (nothing may be running)."""
        self.kv.flush()

    # -- pins --------------------------------------------------------------------------
    def pin(self, msg: Control, req: TokenizedRequest) -> ControlReply | None:
        """Pin `req`'s prefix (the `PinCall` in `msg`) if it is cached whole, or refuse:
        the answer. None: the prefix must be prefilled first (see the module docstring)."""
        op, caller = msg.op, msg.caller
        assert isinstance(op, PinCall)
        key = PinnedPrefixes.key(req.input_ids, self.page_size, req.namespace)
        try:
            if not self.radix_cache.enabled:
                raise ValueError("pinning needs the prefix cache (enable_prefix_cache is off)")
            if not key[1]:
                raise ValueError(f"the prefix has {len(req.input_ids)} tokens, less than one "
                                 f"page (page_size={self.page_size}): nothing to pin")
            self.pins.expire()
            if key not in self.pins.pins:
                self.pins.check_size(len(key[1]), caller.owner, caller.quota)
            if key in self.pins.pins or self.radix_cache.match_prefix(
                    key[1], peek=True, namespace=key[0]).length == len(key[1]):
                return ControlReply(msg.call_id, self.pins.pin(key, op.ttl, caller.owner,
                                                               caller.quota))
        except ValueError as e:
            return ControlReply(msg.call_id, {}, error=str(e))
        return None

    def pin_after_prefill(self, msg: Control, req: TokenizedRequest) -> None:
        """`req`, the pin's prefill, is queued: pin its prefix once it finishes
        (`prefilled`)."""
        self._pinning[req.rid] = (msg, PinnedPrefixes.key(req.input_ids, self.page_size,
                                                          req.namespace))

    def prefilled(self, rid: str, reason: dict[str, Any]) -> bool:
        """The request `rid` has finished for `reason`: if it was a pin's prefill, pin its
        prefix now (or say why not) and return True."""
        waiting = self._pinning.pop(rid, None)
        if waiting is None:
            return False
        msg, key = waiting
        if reason.get("type") == "abort":
            reply = ControlReply(msg.call_id, {}, error=f"the prefix was not prefilled: "
                                 f"{reason.get('message', 'aborted')}")
        else:
            op, caller = msg.op, msg.caller
            assert isinstance(op, PinCall)
            try:
                reply = ControlReply(msg.call_id, self.pins.pin(key, op.ttl, caller.owner,
                                                                caller.quota))
            except ValueError as e:
                reply = ControlReply(msg.call_id, {}, error=str(e))
        self.outbox.append(reply)
        return True

    def unpin(self, op: UnpinCall, caller: Caller) -> dict:
        """Drop the pin of `op.input_ids` in the caller's namespace, or with `op.all` every
        pin in the caller's scope; the answer gives the caller's (owner's) pinned total."""
        self.pins.expire()
        if op.all:
            return self.pins.unpin([k for k in self.pins.pins if caller.scope.admits(k[0])],
                                   caller.owner)
        return self.pins.unpin([PinnedPrefixes.key(op.input_ids or [], self.page_size,
                                                   caller.namespace)], caller.owner)

    # -- views -------------------------------------------------------------------------
    def cache_info(self, top: int, scope: CacheScope = CacheScope()) -> dict:
        """`RadixCache.summary` (its `top` prefixes) of the namespaces `scope` admits, with
        their pins (`{"namespace", "tokens", "expires_in", "head_ids"}`) and the limit."""
        self.pins.expire()
        admits = scope.admits
        info = self.radix_cache.summary(top, admits)
        now = time.monotonic()
        info["pins"] = [{"namespace": ns, **pin.describe(now),
                         "head_ids": list(tokens[:HEAD_TOKENS])}
                        for (ns, tokens), pin in self.pins.pins.items() if admits(ns)]
        info["max_pinned_tokens"] = self.pins.max_pinned_tokens
        return info

    def stats(self) -> dict:
        self.pins.expire()  # so that pinned_tokens is never a lapsed pin's
        allocator, kv = self.allocator, self.kv
        return {
            **self.radix_cache.stats(),
            "num_blocks": allocator.num_blocks, "free_blocks": allocator.num_free,
            "evictable_blocks": kv.evictable_blocks,
            "locked_blocks": self.radix_cache.locked_blocks,
            "partial_blocks": len(kv.partials), "partial_tokens": kv.partial_tokens,
            "pool_usage": 1 - allocator.num_free / allocator.num_blocks,
            "copied_blocks": kv.copied_blocks, "peak_used_blocks": allocator.peak_used,
        }

    def check_invariants(self, running: list[Req], waiting: list[Req]) -> None:
        """The KV-block invariant (`KVManager.check_invariants`): the running sequences
        hold blocks, the waiting ones none. Raises AssertionError otherwise."""
        self.kv.check_invariants((r.name, r.kv) for r in running)
        assert all(not r.kv.block_table for r in waiting), "a waiting request holds blocks"

    # -- the disk tier's index ---------------------------------------------------------
    @property
    def has_disk(self) -> bool:
        return self.disk_dir is not None

    def maybe_save_index(self) -> None:
        """Save the tree's index if `kv_persist_interval` has passed since the last save."""
        interval = self.config.kv_persist_interval
        if (self.disk_dir is not None and interval > 0
                and time.monotonic() - self._index_saved_at >= interval):
            self.save_index()

    def save_index(self) -> None:
        assert self.disk_dir is not None
        save_index(self.disk_dir, self.radix_cache, self.info.kv_fingerprint)
        self._index_saved_at = time.monotonic()

    def release_store(self) -> None:
        """Let another scheduler use the disk tier's directory (after the last save)."""
        self._disk_lock.close()

    def close(self) -> ForwardBatch:
        """With a disk tier, once no sequence holds blocks: drop the pins and write every
        cached prefix to disk. Returns the step that does it (the transfers, and wait until
        they are on disk), after which `save_index` records the tree."""
        disk = self.radix_cache.disk
        assert disk is not None
        self.pins.unpin(list(self.pins.pins))
        self.kv.flush_partials()
        self.radix_cache.evict(sys.maxsize)
        forward = disk.send_with(ForwardBatch(seqs=[], input_ids=[], q_lens=[], kv_lens=[],
                                              logprobs=[]))
        forward.kv_sync = True
        return forward
