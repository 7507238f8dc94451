"""Attack test for issue 53's finding 7 (one tenant's adapters held every LoRA slot, so
another tenant's adapter never ran, and the operator could not unload an adapter in use),
on the two-tenant harness, with other sizes than the review's (two slots, two adapters):
three slots, bob's long requests on three adapters (every slot), alice's request on a
fourth. Alice's requests run within max(3x, +2 s) of their unloaded latency (a slot is
taken back from bob: `TenantShares.slot_victim`), and the operator's unload of one of
bob's adapters in use succeeds, its requests ending with an abort naming the unload.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import pytest

from tests.factories import tiny_model_dir
from tests.lora.adapters import peft_adapter
from tests.server.attack_harness import (VICTIM_CALL, AttackServer, assert_unaffected,
                                         attack_server)

BOBS = ("bob-1", "bob-2", "bob-3")
ALICES = "alice-4"
LONG = {"max_new_tokens": 1900, "ignore_eos": True, "temperature": 1.0}
"""Bob's requests: far longer than the test (they end by the unload or bob's abort)."""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tiny = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")
    root = tmp_path_factory.getbasetemp() / "lora-adapters"
    paths = [f"{name}={peft_adapter(tiny, root, rank=4, alpha=8, scale=10.0, seed=i + 10)}"
             for i, name in enumerate((*BOBS, ALICES))]
    with attack_server(tmp_path_factory, lora_paths=paths, max_lora_rank=8,
                       lora_target_modules=["all"], max_loras_per_batch=3,
                       max_loaded_loras=4, max_total_tokens=16384) as s:
        yield s


def test_bobs_adapters_in_every_slot_neither_keep_alice_out_nor_block_the_unload(
        server: AttackServer):
    outcomes: dict[str, Any] = {}

    def attack(s: AttackServer) -> None:
        def run(name: str, i: int) -> None:
            outcomes[name] = s.bob.generate(input_ids=[[100 + i, 200, 300], [100 + i, 500]],
                                            sampling_params=[LONG, LONG], lora_name=name,
                                            rid=[f"{name}-a", f"{name}-b"])

        threads = [threading.Thread(target=run, args=(n, i)) for i, n in enumerate(BOBS)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30  # all six running: every slot is bob's
        while s.operator.stats()["running"] < 6:
            assert time.monotonic() < deadline, s.operator.stats()
            time.sleep(0.05)
        time.sleep(6)  # alice's requests on her adapter are timed meanwhile (the harness)
        started = time.monotonic()
        s.operator.unload_lora_adapter(BOBS[0])  # in use: unloaded, not refused
        outcomes["unload_s"] = time.monotonic() - started
        threads[0].join(30)
        for name in BOBS[1:]:
            s.bob.abort(f"{name}-a")
            s.bob.abort(f"{name}-b")
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "a request of bob's did not end"

    alices = {**VICTIM_CALL, "lora_name": ALICES}
    report = assert_unaffected(server, attack, max_latency_ratio=3, max_rss_growth_mib=300,
                               victim_call=alices, settle_s=3.0)
    base = statistics.median(report.unloaded_s)
    print(report, f"; the unload took {outcomes['unload_s']:.2f} s")
    assert max(report.loaded_s) < max(3 * base, base + 2.0), report
    for out in outcomes[BOBS[0]]:
        finish = out["meta_info"]["finish_reason"]
        assert finish["type"] == "abort", finish
        assert finish["message"] == f"the operator unloaded LoRA adapter {BOBS[0]!r}", finish
    assert outcomes["unload_s"] < 5, outcomes["unload_s"]
    assert BOBS[0] not in [a["name"] for a in server.operator.list_lora_adapters()]
