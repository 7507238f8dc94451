"""API keys through the router: it checks callers as a server does, routes within each
tenant's namespace, and a tenant never gets another's cached prefix through it; rids are
scoped by tenant, and every abort reaches its caller's own requests only."""

from __future__ import annotations

import json
import time

import httpx
import msgspec
import pytest
import zmq

from radixserve.client import Client, ServerError
from radixserve.messages import GenerateCall
from radixserve.router.runtime import RouterRuntime
from tests.router.conftest import start_replicas, stop_all, system_prompt
from tests.server.survival import assert_survived, baseline

KEYS = ["sk-alice=alice", "sk-bob=bob"]
GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
LONG = {"temperature": 0, "max_new_tokens": 1500, "ignore_eos": True}
"""Alice's stream: long enough to outlive every attack (checked, not assumed)."""
BOB = {"Authorization": "Bearer sk-bob"}


@pytest.fixture(scope="module")
def fleet(tiny):
    """Two replicas with alice's and bob's keys, and a router with the same keys."""
    replicas = start_replicas(tiny, 2, api_key=KEYS, max_total_tokens=4096)
    try:
        with RouterRuntime(replica=[r.rpc_address for r in replicas], api_key=KEYS) as rt:
            yield rt, replicas
    finally:
        stop_all(replicas)


def test_tenants_through_the_router(fleet):
    rt, _ = fleet
    with Client(rt.rpc_address, api_key="sk-alice", timeout=120) as alice, \
            Client(rt.rpc_address, api_key="sk-bob", timeout=120) as bob, \
            Client(rt.rpc_address, api_key="sk-mallory", timeout=120) as mallory:
        prompt = system_prompt(40) + "Secret question?\n"
        first = alice.generate(prompt, GREEDY)
        again = alice.generate(prompt, GREEDY)
        assert again["meta_info"]["cached_tokens"] > 0
        assert again["meta_info"]["replica"] == first["meta_info"]["replica"]
        assert alice.workers()["routed_by_reason"].get("cache_hit") == 1
        theirs = bob.generate(prompt, GREEDY)
        assert theirs["meta_info"]["cached_tokens"] == 0, "bob never gets alice's prefix"
        assert theirs["output_ids"] == first["output_ids"]
        salted = alice.generate(prompt, GREEDY, cache_salt="other")
        assert salted["meta_info"]["cached_tokens"] == 0
        with pytest.raises(ServerError) as refused:
            mallory.generate(prompt, GREEDY)
        assert refused.value.code == "unauthorized"
        # The router's HTTP API checks the bearer key as a server's does.
        url = rt.http_url + "/generate"
        body = {"text": prompt, "sampling_params": GREEDY}
        assert httpx.post(url, json=body, timeout=60).status_code == 401
        ok = httpx.post(url, json=body, timeout=60,
                        headers={"Authorization": "Bearer sk-alice"})
        assert ok.status_code == 200 and ok.json()["meta_info"]["cached_tokens"] > 0


def events(lines) -> list[dict]:
    return [json.loads(line[6:]) for line in lines
            if line.startswith("data: ") and line != "data: [DONE]"]


def leave_mid_stream(address: str, api_key: str, rid: str) -> None:
    """A raw client that starts a stream, reads its first chunk and goes away without a
    word: only the router's own abort can end its request."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    sock.send(msgspec.msgpack.encode(GenerateCall(
        call_id=1, input_ids=[9, 8, 7], sampling_params=LONG, stream=True, rid=rid,
        api_key=api_key)))
    assert sock.poll(60_000), "no first chunk"
    sock.recv()
    sock.close(linger=0)
    ctx.term()


def test_rids_are_scoped_by_tenant_through_the_router(fleet):
    """Issue 25, class 7, through the router: bob reuses alice's rid and hangs up (HTTP),
    aborts it (HTTP, RPC), abandons an RPC stream of it, and leaves a raw stream of his
    own: alice's stream ends intact, each of bob's requests ends when he leaves it (the
    router aborts as bob), and bob's explicit aborts of his own requests land."""
    rt, replicas = fleet
    with Client(rt.rpc_address, api_key="sk-alice", timeout=120) as alice, \
            Client(rt.rpc_address, api_key="sk-bob", timeout=120) as bob, \
            httpx.Client(base_url=rt.http_url, timeout=120) as http:
        before = baseline(alice)
        decoded = alice.stats()["decode_tokens"]
        started = time.monotonic()
        theirs = alice.generate(input_ids=[7, 8, 9], sampling_params=LONG, stream=True,
                                rid="shared")
        next(theirs)
        with http.stream("POST", "/generate", headers=BOB, json={
                "input_ids": [9, 8, 7], "sampling_params": LONG, "rid": "shared",
                "stream": True}) as r:
            assert r.status_code == 200 and "text" in events([next(r.iter_lines())])[0]
        for body in ({"rid": "shared"}, {"abort_all": True}):
            assert http.post("/abort_request", headers=BOB, json=body).status_code == 200
        assert bob.abort("shared") == {"aborted": "shared"}
        chunks = bob.generate(input_ids=[9, 8, 7], sampling_params=LONG, stream=True,
                              rid="shared")
        next(chunks)
        chunks.close()  # abandoned: bob's client aborts it through the router
        leave_mid_stream(rt.rpc_address, "sk-bob", "gone")
        attacked = time.monotonic() - started
        final = [c for c in theirs if "final" in c][0]["final"]["meta_info"]
        assert final["finish_reason"]["type"] == "length", final["finish_reason"]
        assert final["completion_tokens"] == LONG["max_new_tokens"] and final["id"] == "shared"
        assert final["e2e_latency"] > attacked, "alice finished before the attacks"
        # Each of bob's three requests ended when he left it (else each decodes LONG too).
        assert alice.stats()["decode_tokens"] - decoded < 2 * LONG["max_new_tokens"]
        # Bob's aborts of his own requests land, over RPC and HTTP.
        mine = bob.generate(input_ids=[9, 8, 7], sampling_params=LONG, stream=True, rid="own")
        next(mine)
        bob.abort("own")
        ended = [c for c in mine if "final" in c][0]["final"]["meta_info"]
        assert ended["finish_reason"]["type"] == "abort" and ended["id"] == "own"
        with http.stream("POST", "/generate", headers=BOB, json={
                "input_ids": [9, 8, 7], "sampling_params": LONG, "rid": "own-http",
                "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            assert http.post("/abort_request", headers=BOB, json={"rid": "own-http"}
                             ).status_code == 200
            ended = events(lines)[-1]["meta_info"]
        assert ended["finish_reason"]["type"] == "abort" and ended["id"] == "own-http"
        assert_survived(alice, before)
        for replica in replicas:
            with Client(replica.rpc_address, api_key="sk-alice", timeout=120) as direct:
                assert_survived(direct, baseline(direct))
