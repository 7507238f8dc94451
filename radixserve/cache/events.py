"""Page hashes: how a replica's radix tree names its cached prefixes to a router.

A page's hash names the whole prefix that ends with it: blake2b (8 bytes) over the hash of
the page before it (for the first page, the namespace's seed) and the page's token ids.
The seed is keyed by the deployment's cache secret (`key`, tenants.load_cache_secret), so
only who holds the secret (the replicas and their router) can hash a guessed prompt and
look for it among a replica's hashes. So
a set of page hashes is a radix tree over whole pages: a prompt's longest cached prefix is
its longest run of leading page hashes that are in the set, and since a tree holds only
prefixes (eviction removes leaves first), that run has no holes.

The replica publishes the hashes that enter and leave its tree (`CacheEvents` in
radixserve.messages, over the front door's PUB socket); a router keeps one set per replica and
matches a prompt by hashing its pages the same way. Both sides call `page_hashes`, so
the definition lives here once. Standard library only: the router imports it too.

`EventLog` is the replica's side: what its tree tells it entered and left, kept until the
scheduler takes it (`RadixCache.take_events`) for the next `CacheEvents`.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.cache.node import RadixNode

HASH_BYTES = 8


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=HASH_BYTES).digest()


def namespace_seed(namespace: str | None, key: bytes = b"") -> bytes:
    """The chain's start for a namespace (None: the default namespace), keyed by `key`."""
    data = b"radixserve-ns\0" + (b"" if namespace is None else namespace.encode())
    return hashlib.blake2b(data, digest_size=HASH_BYTES, key=key).digest()


def page_hashes(tokens: Sequence[int], page_size: int, namespace: str | None = None, *,
                parent: int | None = None, key: bytes = b"") -> list[int]:
    """The hash of every whole page of `tokens` (a trailing partial page has none), as
    signed 64-bit ints. `parent`: the hash of the page just before `tokens[0]` (when
    `tokens` continues a hashed prefix); None: `tokens` starts at the namespace's root,
    whose seed `key` (the cache secret; empty: unkeyed, for tests) keys."""
    prev = (namespace_seed(namespace, key) if parent is None
            else parent.to_bytes(HASH_BYTES, "little", signed=True))
    ids = tokens if isinstance(tokens, array) and tokens.typecode == "q" else array("q", tokens)
    out = []
    for start in range(0, len(ids) - page_size + 1, page_size):
        prev = _digest(prev + ids[start:start + page_size].tobytes())
        out.append(int.from_bytes(prev, "little", signed=True))
    return out


@dataclass(frozen=True, slots=True)
class TreeEvents:
    """What entered and left the tree between two `RadixCache.take_events` calls, as page
    hashes. Applied in the order cleared, removed, stored to the set the tree held at the
    previous call (or to any set between that and now, such as a snapshot taken meanwhile),
    it gives the set the tree holds now."""

    stored: list[int]
    removed: list[int]
    cleared: bool
    """The tree was flushed since the previous call (before `removed` and `stored`)."""
    blocks: list[Any] = field(default_factory=list)
    """The same changes as vLLM's KV events, in order (cache/block_events.py), when the
    cache keeps them; else empty."""

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.cleared)


class EventLog:
    """The page hashes that entered the tree (a leaf added by an insert), left it (a node
    evicted or dropped) and whether it was flushed, until `take` hands them over. A split
    changes no page's hash, so it is no event; nor is a node's move to the disk tier or
    back (`moved`): its pages stay in the tree, and a request for them is a hit."""

    def __init__(self) -> None:
        # Ordered sets (dicts): a hash is reported once, in the order it happened.
        self._stored: dict[int, None] = {}
        self._removed: dict[int, None] = {}
        self._cleared = False
        self.changed = False
        """Whether the next `take` has anything to say (an attribute, so a loop that asks
        after every step pays no call while the tree stands still)."""

    def stored(self, node: RadixNode) -> None:
        """`node`'s pages entered the tree."""
        self._stored.update(dict.fromkeys(node.hashes))
        self.changed = self.changed or bool(self._stored)

    def removed(self, nodes: Iterable[RadixNode]) -> None:
        """`nodes`' pages left the tree. Reported removed even when they were stored since
        the last `take` (not just dropped from the stored ones): a subscriber may hold them
        from a snapshot taken in between."""
        stored, removed = self._stored, self._removed
        for node in nodes:
            for h in node.hashes:
                stored.pop(h, None)
                removed[h] = None
        self.changed = self.changed or bool(removed)

    def moved(self, node: RadixNode) -> None:
        """`node`'s KV went to the disk tier or came back: no change to the page set."""

    def cleared(self) -> None:
        """The tree was emptied: everything before is void, and `cleared` says so alone."""
        self._stored.clear()
        self._removed.clear()
        self._cleared = self.changed = True

    def take(self) -> TreeEvents:
        """What happened since the previous call, forgotten here. A hash stored after being
        removed is in both lists (removed, then stored: it is in the tree); one removed
        after being stored is only in `removed`."""
        events = TreeEvents(list(self._stored), list(self._removed), self._cleared)
        self._stored, self._removed, self._cleared, self.changed = {}, {}, False, False
        return events


class NoEventLog:
    """An `EventLog` for a cache that records no events (nothing would drain them)."""

    changed = False

    def stored(self, node: RadixNode) -> None:
        pass

    def removed(self, nodes: Iterable[RadixNode]) -> None:
        pass

    def moved(self, node: RadixNode) -> None:
        pass

    def cleared(self) -> None:
        pass

    def take(self) -> TreeEvents:
        raise RuntimeError("this RadixCache does not record events (record_events=False)")
