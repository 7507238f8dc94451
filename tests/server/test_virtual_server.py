"""The virtual KV layout behind the three processes: the worker process's views map the
blocks a request used, and a flush over RPC unmaps them there (the memfd's mappings in
that process are back to the pool's own one); `serve --kv-layout virtual` and nothing
else starts, logs its mapping budget and shows it in /get_server_info and /metrics."""

from __future__ import annotations

import httpx
import psutil

from radixserve.client import Client
from radixserve.server.runtime import Runtime
from tests.factories import tiny_model_dir
from tests.server.conftest import assert_idle_and_all_free
from tests.server.test_disk_restart import serve_with, stop


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


def test_serve_with_the_virtual_layout_alone(model_dir):
    proc, url, started = serve_with(model_dir, "--kv-layout", "virtual")
    try:
        assert "a budget of" in started and "view mappings" in started, started
        assert "/ 60 per view mapping" in started, started  # a region per layer's K and V
        r = httpx.post(f"{url}/generate", timeout=120, json={
            "text": "The capital of France is", "sampling_params": {"max_new_tokens": 4}})
        r.raise_for_status()
        info = httpx.get(f"{url}/get_server_info", timeout=30).json()
        stats = info["internal_states"][0]
        assert info["kv_layout"] == "virtual" and info["max_running_requests"] == 128
        assert 2 * 513 < stats["kv_mapping_budget"] < 65530 // 60, stats
        assert stats["kv_mappings"] > 1, stats  # the views of the request, still mapped
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert f"radixserve_kv_mapping_budget {float(stats['kv_mapping_budget'])}" in metrics
        assert "radixserve_kv_mappings " in metrics
        assert httpx.post(f"{url}/flush_cache", timeout=60).status_code == 200
        stats = httpx.get(f"{url}/get_server_info", timeout=30).json()["internal_states"][0]
        assert stats["kv_mappings"] == 1 and stats["running"] == stats["waiting"] == 0, stats
        assert stats["free_blocks"] == stats["num_blocks"], stats
    finally:
        stop(proc, url)
