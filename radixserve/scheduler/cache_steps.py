"""The cache's optional parts in the scheduler's step, as step features (scheduler/
features.py) over the `CacheService`:

- `PinSteps`, on from the first pin (or a pin restored from the disk tier): pins lapse
  before each step, and a pin's prefill, when it ends, pins its prefix and answers nobody.
- `DiskSteps`, on with a disk tier: each step carries the tier's saves, loads and deletes
  and the prefixes read back for admitted requests; its fold puts what was read in the
  tree; the index is saved every `kv_persist_interval` seconds.
"""

from __future__ import annotations

from typing import Any

from radixserve.messages import ForwardResult
from radixserve.scheduler.batch import ScheduledBatch
from radixserve.scheduler.cache_service import CacheService
from radixserve.scheduler.features import StepFeature
from radixserve.scheduler.request import Req


class PinSteps(StepFeature):
    def __init__(self, cache: CacheService) -> None:
        self.cache = cache

    def start_step(self) -> None:
        self.cache.pins.expire()

    def finished(self, req: Req, reason: dict[str, Any]) -> bool:
        return self.cache.prefilled(req.rid, reason)


class DiskSteps(StepFeature):
    def __init__(self, cache: CacheService) -> None:
        self.cache = cache

    def wants_step(self) -> bool:
        return self.cache.has_transfers

    def launched(self, batch: ScheduledBatch) -> None:
        batch.loads = self.cache.kv.disk_loads.take()
        self.cache.send_transfers(batch.forward)

    def folded(self, batch: ScheduledBatch, result: ForwardResult | None) -> set[int]:
        """What the step read in the tree (nothing when it failed: the nodes stay on disk)."""
        self.cache.kv.disk_loads.finish(batch.loads, None if result is None else result.kv_failed)
        self.cache.maybe_save_index()
        return set()
