"""The virtual KV layout behind the three processes: the worker process's views map the
blocks a request used, and a flush over RPC unmaps them there (the memfd's mappings in
that process are back to the pool's own one)."""

from __future__ import annotations

import psutil

from radixserve.client import Client
from radixserve.server.runtime import Runtime
from tests.factories import tiny_model_dir
from tests.server.conftest import assert_idle_and_all_free


def pool_mappings() -> int:
    """Mappings of the KV memfd in this process's descendants (the worker's pool and its
    views)."""
    count = 0
    for child in psutil.Process().children(recursive=True):
        try:
            with open(f"/proc/{child.pid}/maps") as f:
                count += sum("radixserve-kv" in line for line in f)
        except OSError:
            continue
    return count


def test_a_flush_unmaps_the_worker_processes_views(tmp_path_factory):
    tiny = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")
    with Runtime(str(tiny), kv_layout="virtual", max_running_requests=8,
                 max_total_tokens=2048, debug_invariants=True) as rt:
        with Client(rt.rpc_address, timeout=120) as client:
            client.generate(input_ids=[[5, 17, 230, 4000, 99] * 20, list(range(300, 340))],
                            sampling_params={"max_new_tokens": 4, "temperature": 0})
            assert pool_mappings() > 1  # the pool, and views onto its blocks
            assert_idle_and_all_free(client)  # flushes
            assert pool_mappings() == 1  # the pool alone
