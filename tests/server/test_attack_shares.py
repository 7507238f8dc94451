"""Attack tests for issue 41's findings 5 (no tenant's share of the queue) and 11 (the
operator cannot stop a runaway tenant), on the two-tenant harness: bob floods the server
while alice's plain requests run; alice's latency and the server's memory stay within
bounds, and the operator stops bob, over RPC and HTTP."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from radixserve.client import ServerError
from tests.server.attack_harness import (BOB, BOB_KEY, OPERATOR_KEY, AttackServer,
                                         assert_unaffected, attack_server, bearer)

QUEUE_SHARE = 64
FLOOD = {"sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with attack_server(tmp_path_factory, max_total_tokens=8192, debug_invariants=True,
                       max_queued_requests=256, max_queued_requests_per_tenant=QUEUE_SHARE,
                       max_running_requests=16) as s:
        yield s


def flood(s: AttackServer, calls: int) -> list[BaseException]:
    """Bob's `calls` batches of QUEUE_SHARE prompts at once, each over his share with the
    others queued: what each got back (errors only)."""
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            s.bob.generate(prompt=[f"flood {i} {j}" for j in range(QUEUE_SHARE)], **FLOOD)
        except ServerError as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return errors


def test_bob_filling_his_queue_share_neither_starves_alice_nor_fills_the_queue(server):
    """Finding 5: before, one tenant's batch filled the global queue and the other's
    4-token request did not finish within 600 s."""
    def attack(s: AttackServer) -> None:
        errors = flood(s, 3)  # 192 outputs against a share of 64
        assert errors and all(e.code == "overloaded" for e in errors), errors
        assert all("max_queued_requests_per_tenant" in e.message for e in errors)

    report = assert_unaffected(server, attack, max_latency_ratio=5, max_rss_growth_mib=400)
    print(report)


@pytest.mark.parametrize("surface", ["rpc", "http"])
def test_the_operator_stops_bob_and_alice_is_unaffected(server, surface):
    """Finding 11: the operator's abort_all, naming bob, ends all of bob's requests (over
    RPC and HTTP); bob's own abort_all cannot name alice."""
    def attack(s: AttackServer) -> None:
        flooding = threading.Thread(target=flood, args=(s, 1))
        flooding.start()
        with pytest.raises(ServerError, match="only the operator"):
            s.bob.abort_all(tenant="alice")
        deadline = time.monotonic() + 60
        while (st := s.operator.stats())["waiting"] + st["running"] < 8:
            assert time.monotonic() < deadline, "bob's flood never arrived"
            time.sleep(0.05)
        if surface == "rpc":
            aborted = s.operator.abort_all(tenant=BOB)["aborted"]
        else:
            with httpx.Client(base_url=s.http_url, timeout=60) as http:
                r = http.post("/abort_request", headers=bearer(OPERATOR_KEY),
                              json={"abort_all": True, "tenant": BOB})
                assert r.status_code == 200, r.text
                aborted = r.json()["aborted"]
                refused = http.post("/abort_request", headers=bearer(BOB_KEY),
                                    json={"abort_all": True, "tenant": "alice"})
                assert refused.status_code == 400
        assert aborted >= 1
        flooding.join(120)
        assert not flooding.is_alive(), "bob's requests were not aborted"

    assert_unaffected(server, attack, max_latency_ratio=5, max_rss_growth_mib=400)
