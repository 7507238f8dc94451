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
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

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
