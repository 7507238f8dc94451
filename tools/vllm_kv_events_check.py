"""Decode radixserve's KV events with vLLM's own classes, loaded alone from its wheel.

vLLM cannot be imported without its dependencies (torch with CUDA, and more), but its event
classes need only msgspec: this loads `vllm/distributed/kv_events.py` by itself, with the
few names it imports from the rest of vLLM stubbed, encodes the events a radix tree with a
disk tier reports through inserts, evictions, loads and flushes (both hashings, tenants'
namespaces and an adapter's), and decodes them with vLLM's `KVEventBatch`, field by field.

    pip download vllm==0.34.0 --no-deps -d /tmp/vllm
    cd /tmp/vllm && unzip -o vllm-*.whl vllm/distributed/kv_events.py
    python -m tools.vllm_kv_events_check /tmp/vllm/vllm/distributed/kv_events.py
"""

from __future__ import annotations

import importlib.util
import logging
import random
import sys
import time
import types

import msgspec

from radixserve.messages.kv_events import KVEventBatch
from radixserve.tenants import adapter_namespace
from tests.cache.test_block_events import harness

STUBBED = ("vllm", "vllm.config", "vllm.config.kv_events", "vllm.logger", "vllm.utils",
           "vllm.utils.network_utils", "vllm.v1", "vllm.v1.core", "vllm.v1.core.kv_cache_utils")


def load_vllm_events(path: str) -> types.ModuleType:
    for name in STUBBED:
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["vllm.config.kv_events"].KVEventsConfig = object  # type: ignore[attr-defined]
    sys.modules["vllm.logger"].init_logger = logging.getLogger  # type: ignore[attr-defined]
    for name in ("get_ip", "get_tcp_uri", "is_valid_ipv6_address", "split_zmq_path"):
        setattr(sys.modules["vllm.utils.network_utils"], name, None)
    sys.modules["vllm.v1.core.kv_cache_utils"].ExternalBlockHash = bytes | int  # type: ignore
    spec = importlib.util.spec_from_file_location("vllm_kv_events", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def as_tuples(extra_keys: list | None) -> list | None:
    """msgpack has no tuples: each `extra_keys` entry as a tuple, to compare."""
    return None if extra_keys is None else [None if x is None else tuple(x) for x in extra_keys]


def main(path: str) -> None:
    vllm = load_vllm_events(path)
    decoder, encoder, checked = msgspec.msgpack.Decoder(vllm.KVEventBatch), \
        msgspec.msgpack.Encoder(), 0
    for hashing in ("radixserve", "llm-d"):
        h, rng = harness(hashing, num_blocks=10, disk_pages=12), random.Random(1)
        for step in range(40):
            h.request([rng.randrange(50) for _ in range(rng.choice([4, 8]))],
                      ns=rng.choice([None, "ns-x", adapter_namespace("ns-x", "fp1")]))
            if step % 13 == 12:
                h.cache.flush()
            events = h.cache.take_events().blocks
            batch = decoder.decode(encoder.encode(KVEventBatch(time.time(), events)))
            assert len(batch.events) == len(events)
            for mine, theirs in zip(events, batch.events):
                assert type(mine).__name__ == type(theirs).__name__
                for name in mine.__struct_fields__:
                    want, got = getattr(mine, name), getattr(theirs, name)
                    if name == "extra_keys":
                        got = as_tuples(got)
                    assert want == got, (name, mine, theirs)
            checked += len(events)
    print(f"{path}: {checked} events decoded by vLLM's KVEventBatch, every field equal")


if __name__ == "__main__":
    main(sys.argv[1])
