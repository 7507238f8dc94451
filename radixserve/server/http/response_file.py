"""Stored responses on the disk tier's directory (`--kv-disk-dir`), so that a restart on
the same directory keeps them: `DIR/responses.msgpack` (`disk_layout.RESPONSES_NAME`).

**What is saved**: every stored response not yet expired, with its tenant, its expiry as
wall-clock time (a restart's monotonic clock starts afresh), its response object, its
conversation and the prompt ids it pinned. Its byte accounting is recomputed from those on
load, and the bounds of the running server (count, bytes, TTL: a shorter TTL shortens what
is left) are applied again, the oldest dropped first; expired responses, and those of a
tenant no key names any more, are dropped.

**When**: after each change (a response stored, dropped, expired or deleted), debounced by
`SAVE_DELAY` seconds so that a burst of turns is one write, and at shutdown. A write encodes
the whole store, so it runs off the HTTP event loop (`asyncio.to_thread`); the store itself
is only read on the loop (a snapshot of references: a stored response is never changed once
stored). A crash loses at most the last `SAVE_DELAY` seconds of changes (a response
deleted just before a crash may come back, until its TTL). A server that changed nothing
writes nothing, so a second server refused the directory (its scheduler cannot take the
lock) never overwrites the first one's file.

**Pins**: a restart loses every pin (they live in the scheduler's tree). A loaded response
holds none (`Stored.pinned` None, nothing to release); it keeps the prompt ids to pin again
(`Stored.prompt`), which its next continuation does before it is prefilled
(`responses_api`), bounded by the TTL it has left and `max_pin_ttl`. A response saved by
another model keeps its conversation but not those ids.

**Format**: msgpack with typed msgspec decoding (never pickle), at most `MAX_FILE_BYTES`
(a larger file is refused, and so is the save past it: the oldest responses are left out).
Each response object is JSON text inside, decoded as JSON (no msgpack extension can get
in). A file that is unreadable, too large, of another version or of the wrong shape is
refused with one log line naming why: the server starts with no stored response. Every
file operation goes through the directory as it was pinned at start (`disk_layout.pinned`):
written under a temporary name and renamed into place (`PinnedDir.write_temp`), read
without following a symbolic link.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from array import array
from typing import Any, Iterable

import msgspec

from radixserve.disk_layout import RESPONSES_NAME, PinnedDir
from radixserve.messages import decode
from radixserve.server.http.response_store import ResponseStore, Stored

log = logging.getLogger(__name__)
VERSION = 1
MAX_FILE_BYTES = 1 << 30
SAVE_DELAY = 1.0
"""Seconds between a change and its write (the changes meanwhile join it)."""

Call = dict[str, str | dict[str, str]]
Message = dict[str, str | list[Call]]
"""A chat-template message as `chat.conversation` makes them: strings, and tool calls."""


class SavedResponse(msgspec.Struct, array_like=True):
    tenant: str
    id: str
    expires: float
    """time.time() when it expires."""
    body: bytes
    """The response object, JSON."""
    messages: list[Message]
    prompt: bytes
    """The prompt ids to pin again, `array("i")` bytes; empty: none."""


class SavedResponses(msgspec.Struct, kw_only=True):
    version: int
    model: str
    responses: list[SavedResponse]


_FILE = msgspec.msgpack.Decoder(SavedResponses)
_BODY = msgspec.json.Decoder(dict[str, Any])


Entry = tuple[str, Stored, float, "array | None"]
"""A stored response to save: its tenant, itself, its wall-clock expiry, its prompt ids."""


def snapshot(store: ResponseStore) -> list[Entry]:
    """Every stored response with its tenant, wall-clock expiry and prompt ids, oldest
    first per tenant: cheap, for the event loop (`encode` does the rest off it; the
    response object and conversation are never changed once stored)."""
    now, wall = store.clock(), time.time()
    return [(tenant, stored, wall + stored.expires - now,
             stored.pinned if stored.pinned is not None else stored.prompt)
            for tenant, kept in store.tenants.items() for stored in kept.values()
            if stored.expires > now]


def encode(entries: list[Entry], model: str) -> bytes:
    """The file's bytes; past `MAX_FILE_BYTES`, the responses that expire first are left
    out (with one log line)."""
    budget, kept = MAX_FILE_BYTES - 4096, list[SavedResponse]()
    for tenant, stored, expires, ids in sorted(entries, key=lambda e: -e[2]):
        budget -= stored.size + 256
        if budget < 0:
            log.warning("stored responses: past %d bytes, %d of them are not saved",
                        MAX_FILE_BYTES, len(entries) - len(kept))
            break
        kept.append(SavedResponse(tenant, stored.id, expires, msgspec.json.encode(stored.body),
                                  stored.messages, b"" if ids is None else ids.tobytes()))
    kept.reverse()
    return msgspec.msgpack.encode(SavedResponses(version=VERSION, model=model, responses=kept))


_WRITING = threading.Lock()
"""One write at a time, in the order they were asked for (one left running by a cancelled
writer, then the last one at shutdown)."""


def save(folder: PinnedDir, data: bytes) -> None:
    with _WRITING:
        folder.write_whole(RESPONSES_NAME, data)


def read(folder: PinnedDir) -> SavedResponses | None:
    """The saved file, or None (none, or refused with one log line)."""
    path = folder.path / RESPONSES_NAME
    try:
        saved = decode(_FILE, folder.read_bounded(RESPONSES_NAME, MAX_FILE_BYTES))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, msgspec.DecodeError) as e:
        log.warning("stored responses %s refused (%s): starting with none", path, e)
        return None
    if saved.version != VERSION:
        log.warning("stored responses %s have version %d, not %d: starting with none", path,
                    saved.version, VERSION)
        return None
    return saved


def restore(store: ResponseStore, saved: SavedResponses, model: str,
            tenants: Iterable[str]) -> int:
    """Put `saved`'s responses into `store` (empty), as the module's doc says; returns how
    many are kept."""
    now, wall, known = store.clock(), time.time(), set(tenants)
    ordered = sorted(saved.responses, key=lambda r: r.expires)  # oldest first
    for r in ordered:
        left = min(r.expires - wall, store.ttl)
        if r.tenant not in known or left <= 0 or r.id in store.tenants.get(r.tenant, ()):
            continue
        try:
            body = decode(_BODY, r.body)
        except msgspec.DecodeError as e:
            log.warning("stored response %s skipped: %s", r.id[:64], e)
            continue
        prompt = None
        if r.prompt and len(r.prompt) % 4 == 0 and saved.model == model:
            prompt = array("i")
            prompt.frombytes(r.prompt)
        stored = Stored(r.id, body, [dict(m) for m in r.messages], None, prompt=prompt)
        if store.fits(stored.size):
            store.restore(r.tenant, stored, now + left)
    return sum(len(kept) for kept in store.tenants.values())


class ResponseFile:
    """The store's file: loaded at start, written after changes (`SAVE_DELAY`) and at
    `close`."""

    def __init__(self, folder: PinnedDir, store: ResponseStore, model: str) -> None:
        self.folder, self.store, self.model = folder, store, model
        self.changed = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def start(self, tenants: Iterable[str]) -> None:
        saved = await asyncio.to_thread(read, self.folder)
        if saved is not None:
            kept = restore(self.store, saved, self.model, tenants)
            log.info("stored responses: %d of %d resumed from %s", kept, len(saved.responses),
                     self.folder.path / RESPONSES_NAME)
        self.store.on_change = self.changed.set
        self.task = asyncio.get_running_loop().create_task(self._writer())

    async def _writer(self) -> None:
        while True:
            await self.changed.wait()
            await asyncio.sleep(SAVE_DELAY)
            await self.flush()

    async def flush(self) -> None:
        """Write the store now if it changed since the last write."""
        if not self.changed.is_set():
            return
        self.changed.clear()
        entries = snapshot(self.store)
        try:
            await asyncio.to_thread(lambda: save(self.folder, encode(entries, self.model)))
        except OSError as e:  # written again after the next change
            log.warning("stored responses not saved to %s: %s", self.folder.path, e)
            self.changed.set()

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass
        await self.flush()
