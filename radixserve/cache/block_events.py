"""The tree's changes as vLLM's KV events (messages/kv_events.py), for the routers that read
vLLM's (llm-d's indexer, Dynamo, Ray), beside the page-hash events radixserve's own router
reads (cache/events.py).

`BlockEventLog` is an `EventLog` that also keeps, for each change, the event a vLLM
replica would publish: an edge added is one `BlockStored` (its pages, the page before it,
its tokens), nodes dropped are a `BlockRemoved` per tier, a node moved to the disk tier
or back is a `BlockRemoved` from one tier and a `BlockStored` in the other, a flush is
`AllBlocksCleared`. A new log starts with `AllBlocksCleared`: a restarted replica's tree
is empty (or only what its disk tier brought back, stored next). `dump` is the whole
tree as `BlockStored` events, parents first, for a subscriber that starts from nothing.

Block hashes, by `hashing`:
- `radixserve`: the tree's own page hashes (cache/events.py), as unsigned 64-bit ints;
  keyed by the cache secret, so only radixserve's router can hash a prompt to match them.
- `llm-d`: llm-d's KV-cache indexer's block keys: the low 64 bits (big-endian) of
  SHA-256 over the canonical CBOR of `[parent, tokens, extra]`, chained from the
  low 64 bits of SHA-256 over the CBOR of the hash seed (`--kv-events-seed`, the
  indexer's `HashSeed`). `extra` is None, or the block's `extra_keys` entry.

`extra_keys`, where vLLM puts them: the adapter's name on every block of a LoRA adapter's
namespace, then the namespace's salt on its first block, where the salt is radixserve's
name for the (tenant, `cache_salt`) pair (tenants.namespace_of: keyed, so it says nothing
of either). Two tenants' or two adapters' blocks therefore never share a hash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Literal

from radixserve.cache.events import EventLog, TreeEvents
from radixserve.cache.node import RadixNode
from radixserve.cache.tree import RadixTree
from radixserve.messages.kv_events import (MEDIUM_STORAGE, AllBlocksCleared, BlockRemoved,
                                           BlockStored, KVEvent)
from radixserve.tenants import ADAPTER_MARK, tenant_part

Hashing = Literal["radixserve", "llm-d"]
U64 = (1 << 64) - 1


def cbor(value: object) -> bytes:
    """Canonical CBOR (RFC 8949 4.2.1) of what a block key holds: non-negative ints, text,
    None, and lists or tuples of them (arrays)."""
    if value is None:
        return b"\xf6"
    if isinstance(value, str):
        data = value.encode()
        return _head(3, len(data)) + data
    if isinstance(value, int) and value >= 0:
        return _head(0, value)
    if isinstance(value, (list, tuple)):
        return _head(4, len(value)) + b"".join(cbor(v) for v in value)
    raise TypeError(f"no CBOR for {type(value).__name__} in a block key")


def _head(major: int, n: int) -> bytes:
    """A data item's head: its major type and `n` in the shortest form."""
    if n < 24:
        return bytes([major << 5 | n])
    for extra, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes([major << 5 | extra]) + n.to_bytes(size, "big")
    raise ValueError(f"{n} does not fit a CBOR head")


def llmd_key(data: object) -> int:
    """The low 64 bits of SHA-256 over `data`'s canonical CBOR, big-endian."""
    return int.from_bytes(hashlib.sha256(cbor(data)).digest()[24:], "big")


def llmd_block_keys(tokens: list[int], block_size: int, seed: str = "",
                    extra: Callable[[int], tuple | None] = lambda i: None,
                    parent: int | None = None) -> list[int]:
    """llm-d's keys of every whole block of `tokens`: `extra(i)` is block i's extra keys,
    `parent` the key of the block before `tokens[0]` (None: the chain's start, `seed`)."""
    prev = llmd_key(seed) if parent is None else parent
    keys = []
    for i in range(len(tokens) // block_size):
        prev = llmd_key([prev, tokens[i * block_size:(i + 1) * block_size], extra(i)])
        keys.append(prev)
    return keys


def lora_id(name: str) -> int:
    """A stable 31-bit id for vLLM's deprecated `lora_id` (from the adapter's name)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest()) >> 1


class BlockEventLog(EventLog):
    """An `EventLog` that also keeps the changes as vLLM KV events until `take`."""

    def __init__(self, tree: RadixTree, medium: str, hashing: Hashing = "radixserve",
                 seed: str = "", adapter_name: Callable[[str], str | None] = lambda fp: None
                 ) -> None:
        """`medium`: the KV pool's (`GPU` or `CPU`); `adapter_name`: an adapter's name from
        its fingerprint (None: not loaded, and its fingerprint stands for its name)."""
        super().__init__()
        self.tree, self.medium, self.hashing, self.seed = tree, medium, hashing, seed
        self.adapter_name = adapter_name
        self._llmd: dict[int, int] = {}
        """llm-d's key of every page in the tree, by its page hash (`llm-d` hashing)."""
        self._blocks: list[KVEvent] = [AllBlocksCleared()]
        self.changed = True

    # -- what the tree reports -----------------------------------------------------------
    def stored(self, node: RadixNode) -> None:
        super().stored(node)
        self._blocks.append(self._stored_event(node))

    def removed(self, nodes: Iterable[RadixNode]) -> None:
        nodes = list(nodes)
        super().removed(nodes)
        gone: dict[str, list[int]] = {}
        for node in nodes:
            gone.setdefault(self._medium(node), []).extend(self._hashes(node))
        self._blocks += [BlockRemoved(hashes, medium) for medium, hashes in gone.items()]
        for node in nodes:
            for h in node.hashes:
                self._llmd.pop(h, None)

    def moved(self, node: RadixNode) -> None:
        was = self.medium if node.on_disk else MEDIUM_STORAGE
        self._blocks += [BlockRemoved(self._hashes(node), was), self._stored_event(node)]
        self.changed = True

    def cleared(self) -> None:
        super().cleared()
        self._blocks = [AllBlocksCleared()]
        self._llmd.clear()

    def take(self) -> TreeEvents:
        events = super().take()
        events.blocks.extend(self._blocks)
        self._blocks = []
        return events

    def dump(self) -> list[KVEvent]:
        """The whole tree: `AllBlocksCleared`, then a `BlockStored` per edge, parents first."""
        out: list[KVEvent] = [AllBlocksCleared()]
        level = list(self.tree.root.children.values())
        while level:
            out += [self._stored_event(n) for n in level if n.tokens]
            level = [c for n in level for c in n.children.values()]
        return out

    # -- one edge as vLLM names it -------------------------------------------------------
    def _stored_event(self, node: RadixNode) -> BlockStored:
        tree = self.tree
        *_, top = tree.path(node)
        namespace = top.namespace  # the path's top: a namespace node, or a default one's
        parent = tree.parent(node)
        starts = parent.is_root or parent.is_namespace
        tenant = tenant_part(namespace)
        fingerprint = (namespace or "").partition(ADAPTER_MARK)[2] or None
        name = None if fingerprint is None else self.adapter_name(fingerprint) or fingerprint

        def extra(i: int) -> tuple | None:
            keys = (() if name is None else (name,)) + (
                (tenant,) if tenant is not None and starts and i == 0 else ())
            return keys or None

        pages = len(node.hashes)
        if self.hashing == "llm-d":
            parent_hash = None if starts else self._llmd[parent.hashes[-1]]
            hashes = llmd_block_keys(node.tokens.tolist(), tree.page_size, self.seed, extra,
                                     parent_hash)
            self._llmd.update(zip(node.hashes, hashes))
        else:
            parent_hash = None if starts else parent.hashes[-1] & U64
            hashes = [h & U64 for h in node.hashes]
        extras = [extra(i) for i in range(pages)]
        return BlockStored(
            block_hashes=hashes, parent_block_hash=parent_hash, token_ids=node.tokens.tolist(),
            block_size=tree.page_size, lora_id=None if name is None else lora_id(name),
            medium=self._medium(node), lora_name=name,
            extra_keys=extras if any(e is not None for e in extras) else None)

    def _medium(self, node: RadixNode) -> str:
        return MEDIUM_STORAGE if node.on_disk else self.medium

    def _hashes(self, node: RadixNode) -> list[int]:
        if self.hashing == "llm-d":
            return [self._llmd[h] for h in node.hashes]
        return [h & U64 for h in node.hashes]
