"""A vLLM KV-event subscriber, written for the tests from vLLM 0.34.0's
`vllm/distributed/kv_events.py` (the wheel on PyPI), not from radixserve's classes: what
decodes here decodes in vLLM. `Index` keeps what llm-d's indexer and Dynamo keep (block hash
-> parent, tokens, medium, adapter, extra keys); `llmd_keys` computes llm-d's block keys
from its documented recipe (the low 64 bits of SHA-256 over canonical CBOR of
[parent, tokens, extra]) with `cbor2`, independently of radixserve's own encoder."""

from __future__ import annotations

import hashlib
from typing import Any

import cbor2
import msgspec


class VllmEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(VllmEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class VllmBlockRemoved(VllmEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VllmAllBlocksCleared(VllmEvent, tag="AllBlocksCleared"):
    pass


class VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(VllmBatch)


def llmd_key(data: object) -> int:
    return int.from_bytes(hashlib.sha256(cbor2.dumps(data, canonical=True)).digest()[-8:],
                          "big")


def llmd_keys(tokens: list[int], page: int, seed: str,
              extras: list[Any] | None = None) -> list[int]:
    """llm-d's keys of `tokens`' whole pages, chained from `seed`; `extras[i]` is page i's
    extra keys (None for none)."""
    parent, keys = llmd_key(seed), []
    for i in range(len(tokens) // page):
        extra = None if extras is None or extras[i] is None else list(extras[i])
        parent = llmd_key([parent, tokens[i * page:(i + 1) * page], extra])
        keys.append(parent)
    return keys


class Index:
    """What a subscriber keeps: every block it was told of, by hash, as
    (parent, tokens, medium, lora_name, extra keys). `strict` also holds the events to what
    a subscriber that saw every one of them may assume: a block is removed from the medium
    it was stored in, and a parent is known before its child."""

    def __init__(self, page: int, strict: bool = False) -> None:
        self.page, self.strict = page, strict
        self.blocks: dict[int | bytes, tuple] = {}

    def apply(self, events: list) -> None:
        for e in events:
            if isinstance(e, VllmAllBlocksCleared):
                self.blocks.clear()
            elif isinstance(e, VllmBlockRemoved):
                for h in e.block_hashes:
                    gone = self.blocks.pop(h, None)
                    assert not self.strict or (gone and gone[2] == e.medium), \
                        "removed from a tier it was not stored in"
            else:
                assert e.block_size == self.page
                assert len(e.token_ids) == self.page * len(e.block_hashes)
                parent = e.parent_block_hash
                assert not self.strict or parent is None or parent in self.blocks
                for i, h in enumerate(e.block_hashes):
                    extra = e.extra_keys[i] if e.extra_keys else None
                    self.blocks[h] = (parent, tuple(e.token_ids[i * self.page:(i + 1) * self.page]),
                                      e.medium, e.lora_name, extra)
                    parent = h
