"""Stored responses (`/v1/responses` with `store`): what `GET /v1/responses/{id}` shows and
what `previous_response_id` continues.

Each stored response keeps its whole conversation (the template messages of every turn
before it and its own output; not the instructions, which OpenAI does not carry over), so a
continuation is one lookup: there is no chain of ids to walk, and neither a deep nor a
circular chain can be built (ids are the server's own). A conversation holds at most
`MAX_CHAT_MESSAGES` messages and one tenant's stored bytes, so a long chain ends in a 400.

The store is per tenant, in memory (and, with the disk tier, in its directory:
`response_file`): another tenant's id is simply not found. Each tenant
keeps at most `max_stored_responses` of them and `max_stored_response_bytes`, the oldest
dropped first, each for `stored_response_ttl` seconds. What is dropped is handed back to the
caller (`put`, `delete`, `get`), which releases the prefix pin it held (`pinned`, unless
another stored response holds the same one)."""

from __future__ import annotations

import hashlib
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec


@dataclass
class Stored:
    """One stored response."""

    id: str
    body: dict[str, Any]
    """The response object, as the request that made it returned it."""
    messages: list[dict[str, Any]]
    """The conversation through this response's output, as chat-template messages."""
    pinned: array | None = None
    """The prompt ids pinned for the next turn (4 bytes each), if the pin was taken; None
    once the pin is not this response's to release."""
    expires: float = 0.0
    size: int = field(default=0)
    """Bytes counted against the tenant's bound: the conversation, the body, the ids."""
    prompt: array | None = None
    """Loaded after a restart (which loses every pin): the prompt ids to pin again on the
    next continuation (`take_repin`), and to save again until then."""
    repin_taken: bool = False

    def __post_init__(self) -> None:
        ids = self.pinned if self.pinned is not None else self.prompt
        self.size = len(msgspec.json.encode(self.messages)) + len(
            msgspec.json.encode(self.body)) + (ids.itemsize * len(ids) if ids is not None else 0)


class ResponseStore:
    """Per tenant, the stored responses in the order they were stored (oldest first)."""

    def __init__(self, max_count: int, max_bytes: int, ttl: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_count, self.max_bytes, self.ttl, self.clock = max_count, max_bytes, ttl, clock
        self.tenants: dict[str, OrderedDict[str, Stored]] = {}
        self.bytes: dict[str, int] = {}
        self.holders: dict[tuple[str, bytes], int] = {}
        """Stored responses per pinned prefix: a prefix is pinned once however many hold
        it (the same request stored twice), and released with the last of them."""
        self.on_change: Callable[[], None] = lambda: None
        """Called after each change (`response_file` saves then)."""

    def fits(self, size: int) -> bool:
        """Whether one response of `size` bytes may be stored at all."""
        return size <= self.max_bytes

    def put(self, tenant: str, stored: Stored) -> list[Stored]:
        """Store `stored` (it must fit); returns the responses dropped to make room, and
        the expired ones."""
        assert self.fits(stored.size)
        gone = self._expire(tenant)
        kept = self.tenants.setdefault(tenant, OrderedDict())
        stored.expires = self.clock() + self.ttl
        kept[stored.id] = stored
        self.bytes[tenant] = self.bytes.get(tenant, 0) + stored.size
        if stored.pinned is not None:
            held = self._held(tenant, stored.pinned)
            self.holders[held] = self.holders.get(held, 0) + 1
        gone += self._bound(tenant)
        self.on_change()
        return gone

    def restore(self, tenant: str, stored: Stored, expires: float) -> None:
        """Put back a response loaded from disk (after those that expire sooner), holding
        no pin; the bounds apply as they do to `put`."""
        assert self.fits(stored.size) and stored.pinned is None
        stored.expires = expires
        self.tenants.setdefault(tenant, OrderedDict())[stored.id] = stored
        self.bytes[tenant] = self.bytes.get(tenant, 0) + stored.size
        self._bound(tenant)

    def take_repin(self, tenant: str, stored: Stored) -> array | None:
        """The ids a loaded response should pin again (then `repinned`), or None: nothing
        to pin, already claimed, or another stored response holds the same pin (this one
        holds it too now)."""
        ids = stored.prompt
        if ids is None or stored.repin_taken or not self._holds(tenant, stored):
            return None
        stored.repin_taken = True
        held = self._held(tenant, ids)
        if held in self.holders:
            self.holders[held] += 1
            stored.pinned = ids
            return None
        return ids

    def repinned(self, tenant: str, stored: Stored, ids: array) -> bool:
        """After `take_repin`'s ids were pinned: True if the pin is the caller's to release
        at once (the response was dropped meanwhile, and no other holds that pin)."""
        held = self._held(tenant, ids)
        if self._holds(tenant, stored):
            stored.pinned = ids
            self.holders[held] = self.holders.get(held, 0) + 1
            return False
        return held not in self.holders

    def get(self, tenant: str, id: str) -> tuple[Stored | None, list[Stored]]:
        """The tenant's response `id` (None: never stored, another tenant's, dropped or
        expired), and the expired ones dropped on the way."""
        gone = self._expire(tenant)
        return self.tenants.get(tenant, OrderedDict()).get(id), gone

    def _holds(self, tenant: str, stored: Stored) -> bool:
        kept = self.tenants.get(tenant)
        return kept is not None and kept.get(stored.id) is stored

    def _bound(self, tenant: str) -> list[Stored]:
        kept, gone = self.tenants[tenant], []
        while len(kept) > self.max_count or self.bytes[tenant] > self.max_bytes:
            gone.append(self._drop(tenant, next(iter(kept))))
        return gone

    def delete(self, tenant: str, id: str) -> Stored | None:
        if id not in self.tenants.get(tenant, {}):
            return None
        return self._drop(tenant, id)

    def count(self, tenant: str) -> tuple[int, int]:
        """How many responses the tenant has stored, and their bytes."""
        return len(self.tenants.get(tenant, ())), self.bytes.get(tenant, 0)

    def _expire(self, tenant: str) -> list[Stored]:
        kept = self.tenants.get(tenant)
        now, gone = self.clock(), []
        # oldest first, and every one lives as long: the expired ones lead
        while kept and next(iter(kept.values())).expires <= now:
            gone.append(self._drop(tenant, next(iter(kept))))
        return gone

    @staticmethod
    def _held(tenant: str, ids: array) -> tuple[str, bytes]:
        return tenant, hashlib.sha256(ids.tobytes()).digest()

    def _drop(self, tenant: str, id: str) -> Stored:
        stored = self.tenants[tenant].pop(id)
        self.bytes[tenant] -= stored.size
        if stored.pinned is not None:
            held = self._held(tenant, stored.pinned)
            self.holders[held] -= 1
            if self.holders[held]:
                stored.pinned = None  # another stored response still holds the pin
            else:
                del self.holders[held]
        if not self.tenants[tenant]:
            del self.tenants[tenant], self.bytes[tenant]
        self.on_change()
        return stored
