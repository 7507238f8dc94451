"""The tree's changes as vLLM's KV events (cache/block_events.py), read as a vLLM
subscriber reads them (tests/vllm_subscriber.py, vLLM's classes): an index of block hash ->
(parent, tokens, medium, lora, extras) built from the events alone must equal the tree's own
dump after every operation, through inserts, splits, eviction, the disk tier and back, and
flushes; and in `llm-d` hashing, every block's hash is the key llm-d's indexer computes for
that prompt, by its documented recipe, computed with `cbor2` rather than radixserve's own
encoder."""

from __future__ import annotations

import random
from functools import partial

import cbor2
import msgspec
import pytest

from radixserve.cache import RadixCache
from radixserve.cache.block_events import BlockEventLog, cbor
from radixserve.messages.kv_events import (MEDIUM_CPU, MEDIUM_STORAGE, AllBlocksCleared,
                                           BlockRemoved, BlockStored, KVEventBatch)
from radixserve.tenants import ADAPTER_MARK, adapter_namespace
from tests.cache.test_radix_disk import Harness
from tests.vllm_subscriber import DECODER, Index, llmd_keys

PS = 2
SEED = "llm-d-seed"


def as_vllm(events: list) -> list:
    """radixserve's events as vLLM's subscriber decodes them off the wire."""
    return DECODER.decode(msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=events))).events


def index_of(events: list) -> Index:
    index = Index(PS, strict=True)
    index.apply(as_vllm(events))
    return index


def harness(hashing: str, **kwargs) -> Harness:
    h = Harness(page_size=PS, **kwargs)
    h.cache = RadixCache(h.alloc, PS, disk=h.disk, record_events=partial(
        BlockEventLog, medium=MEDIUM_CPU, hashing=hashing, seed=SEED,
        adapter_name=lambda fp: {"fp1": "adapter-a"}.get(fp)))
    return h


def synced(h: Harness, index: Index) -> list:
    """Apply what the tree reported; it must equal a fresh subscriber's dump."""
    events = h.cache.take_events().blocks
    index.apply(as_vllm(events))
    assert index.blocks == index_of(h.cache.events.dump()).blocks  # type: ignore[attr-defined]
    assert len(index.blocks) == len(h.cache.page_hashes_in_tree())
    return events


@pytest.mark.parametrize("hashing", ["radixserve", "llm-d"])
def test_a_subscriber_follows_the_tree_through_eviction_disk_and_flush(hashing):
    h, rng = harness(hashing, num_blocks=10, disk_pages=12), random.Random(5)
    index = Index(PS, strict=True)
    prefixes = [[rng.randrange(1000) for _ in range(6)] for _ in range(3)]
    namespaces = [None, "ns-tenant-b", adapter_namespace(None, "fp1")]
    seen = set()
    for step in range(60):
        tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.choice([0, 2, 5]))]
        h.request(tokens, ns=rng.choice(namespaces))
        if step % 20 == 19:
            h.cache.flush()
        seen |= {(type(e), getattr(e, "medium", None)) for e in synced(h, index)}
    # Every kind of change happened: stored and dropped in memory, spilled, dropped from
    # disk and loaded back (a BlockRemoved from STORAGE with a BlockStored in memory).
    assert seen == {(BlockStored, MEDIUM_CPU), (BlockRemoved, MEDIUM_CPU), (AllBlocksCleared, None),
                    (BlockStored, MEDIUM_STORAGE), (BlockRemoved, MEDIUM_STORAGE)}
    assert h.disk.counters["disk_loads"] > 0


def test_llmd_hashes_equal_the_indexers_keys_with_salts_and_adapters():
    h = harness("llm-d", num_blocks=40)
    shared = list(range(50, 58))
    prompts = [shared + [1, 2, 3, 4], shared + [9, 9], list(range(7, 17))]
    tenant = "ns-0123456789abcdef-salt"
    lora_ns = adapter_namespace(tenant, "fp1")
    for ns in (None, tenant, lora_ns):
        for prompt in prompts:
            h.request(prompt, ns=ns)
    index = index_of(h.cache.take_events().blocks)
    for prompt in prompts:
        pages = len(prompt) // PS
        plain = llmd_keys(prompt, PS, SEED)
        salted = llmd_keys(prompt, PS, SEED, [(tenant,)] + [None] * (pages - 1))
        adapted = llmd_keys(prompt, PS, SEED,
                            [("adapter-a", tenant)] + [("adapter-a",)] * (pages - 1))
        for keys in (plain, salted, adapted):
            assert all(k in index.blocks for k in keys), "a block the indexer would look up"
        assert not set(plain) & set(salted) and not set(salted) & set(adapted)
        assert all(index.blocks[k][3] == "adapter-a" for k in adapted)
        assert all(index.blocks[k][3] is None for k in plain + salted)


def test_radixserve_hashes_are_the_trees_page_hashes_unsigned():
    h = harness("radixserve")
    h.request(list(range(10)))
    stored = [e for e in h.cache.take_events().blocks if isinstance(e, BlockStored)]
    assert [b for e in stored for b in e.block_hashes] == [
        x & (2**64 - 1) for x in h.cache.page_hashes_in_tree()]
    assert stored[0].parent_block_hash is None and stored[0].extra_keys is None


def test_a_new_log_and_a_flush_begin_with_all_blocks_cleared():
    h = harness("radixserve")
    assert isinstance(h.cache.take_events().blocks[0], AllBlocksCleared)
    h.request(list(range(8)))
    h.cache.flush()
    assert h.cache.take_events().blocks == [AllBlocksCleared()]


@pytest.mark.parametrize("value", [0, 23, 24, 255, 256, 65535, 65536, 2**32, 2**64 - 1, "",
                                   "é" * 30, None, [], [1, [2, "x"], None],
                                   (5, ("lora", ADAPTER_MARK))])
def test_the_block_key_cbor_is_canonical(value):
    assert cbor(value) == cbor2.dumps(value, canonical=True)
