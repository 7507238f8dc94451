"""What the router knows of one replica's radix tree: its page hashes, kept exact from the
replica's CacheEvents, plus the prefixes routed there that it has not reported yet.

Exact: the replica publishes every page hash that enters and leaves its tree (a hash names
a whole prefix; see radixserve/cache/events.py), so this set is the tree, not a guess of
it from what was routed (SGLang's router keeps such a guess, LRU-trimmed). The view is
out of step only while events travel (milliseconds), and after lost events or a restart
of either side, which it detects (`seq` gaps, a new `epoch`) and repairs from a snapshot.

Provisional: a prompt's prefix is only in the tree once its prefill has run, so requests
of one group that arrive together would all miss and scatter. Each routed prompt's hashes
count here until shortly after its call ends (`LINGER`): the event that stores its pages
and the call's result travel on different sockets, so the result may come first.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence
from typing import Any

from radixserve.messages import CacheEvents

LINGER = 2.0
"""Seconds a finished call's prefix stays provisional, for its events to arrive."""
MAX_BUFFERED = 1024
"""Events held while a snapshot is awaited; more than that and the next snapshot decides."""


class CacheView:
    def __init__(self) -> None:
        self.hashes: set[int] = set()
        self.provisional: Counter[int] = Counter()
        self.epoch: str | None = None
        self.seq = 0
        self.page_size: int | None = None
        self.synced = False
        self._buffer: list[CacheEvents] = []
        self._releasing: deque[tuple[float, list[int]]] = deque()

    # -- from the replica ---------------------------------------------------------------
    def on_events(self, events: CacheEvents) -> bool:
        """Apply one CacheEvents; True when the view needs a snapshot (it fell out of
        step), which the caller asks for, and then hands to `on_snapshot`."""
        if not self.synced:
            if len(self._buffer) < MAX_BUFFERED:
                self._buffer.append(events)
            return False
        if events.epoch != self.epoch or events.seq != self.seq + 1:
            self.synced = False
            self._buffer = [events]
            return True
        self._apply(events)
        return False

    def on_snapshot(self, snapshot: dict[str, Any]) -> bool:
        """Replace the view with a snapshot (`CacheSnapshotCall`'s result), then replay
        the buffered events that came after it; True if those show a gap still (ask again)."""
        self.hashes = set(snapshot["hashes"])
        self.epoch, self.seq = snapshot["epoch"], snapshot["seq"]
        self.page_size = snapshot["page_size"]
        buffered, self._buffer = self._buffer, []
        self.synced = True
        for events in buffered:
            if events.epoch == self.epoch and events.seq <= self.seq:
                continue  # already in the snapshot
            if self.on_events(events):
                return True
        return False

    def reset(self) -> None:
        """The replica is gone: what it held is gone with it (a new snapshot follows)."""
        self.hashes.clear()
        self.provisional.clear()
        self._releasing.clear()
        self.epoch, self.seq, self.synced = None, 0, False
        self._buffer = []

    def _apply(self, events: CacheEvents) -> None:
        if events.cleared:
            self.hashes.clear()
        self.hashes.difference_update(events.removed)
        self.hashes.update(events.stored)
        self.seq = events.seq
        self.page_size = events.page_size

    # -- from the router ----------------------------------------------------------------
    def matched_pages(self, hashes: Sequence[int]) -> int:
        """Leading pages of a prompt (its page hashes) this replica holds or will soon."""
        exact, provisional = self.hashes, self.provisional
        for i, h in enumerate(hashes):
            if h not in exact and h not in provisional:
                return i
        return len(hashes)

    def hold(self, hashes: Iterable[int]) -> None:
        self.provisional.update(hashes)

    def release(self, hashes: list[int], now: float) -> None:
        """The call that held `hashes` ended: they stop counting `LINGER` seconds later."""
        if hashes:
            self._releasing.append((now + LINGER, hashes))

    def expire(self, now: float) -> None:
        while self._releasing and self._releasing[0][0] <= now:
            hashes = self._releasing.popleft()[1]
            self.provisional.subtract(hashes)
            for h in hashes:
                if self.provisional[h] <= 0:
                    self.provisional.pop(h, None)
