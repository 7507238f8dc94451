"""vLLM's KV events on the wire: what llm-d's KV-cache indexer, NVIDIA Dynamo's router and
Ray's KV-aware router read from a vLLM replica, so that they read radixserve's the same way.

Written from vLLM 0.34.0's `vllm/distributed/kv_events.py` (the wheel on PyPI): a batch
is an array `[ts, events, data_parallel_rank]`; each event is a map tagged by its class
name under `type` (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`). Only the fields
radixserve fills are declared; vLLM's others all have defaults, so a message without them
decodes there. Field names and which of them are required follow vLLM's classes.

A `BlockStored` is one run of consecutive pages (one radix edge): `block_hashes[i]` names
the prefix ending with page i, `parent_block_hash` the page before the run (None: the run
starts its namespace), `token_ids` the run's tokens. `medium` says which tier holds them:
`GPU` (the KV pool on a GPU), `CPU` (the KV pool in host memory, radixserve on a CPU) or
`STORAGE` (the disk tier); a move between tiers is a `BlockRemoved` from one and a
`BlockStored` in the other.
"""

from __future__ import annotations

from typing import Any

from msgspec import Struct

MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE = "GPU", "CPU", "STORAGE"


class BlockStored(Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    """vLLM's deprecated adapter id: a stable number from the adapter's weights here."""
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    """One entry per block: what besides its tokens went into its hash (the adapter's name
    on every block, the namespace's salt on the first), or None."""


class BlockRemoved(Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(Struct, tag=True, omit_defaults=True, gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(Struct, array_like=True, omit_defaults=True, gc=False):
    """One message's payload (its third frame, after the topic and the sequence number)."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None
