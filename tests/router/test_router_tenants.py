"""API keys through the router: it checks callers as a server does, routes within each
tenant's namespace, and a tenant never gets another's cached prefix through it. The
operator's calls need the operator key, and a reply is taken only from the replica its
call went to (issue 25, class 6)."""

from __future__ import annotations

import threading

import httpx
import msgspec
import pytest
import zmq

from radixserve.client import Client, ServerError
from radixserve.messages import ChunkReply, ErrorReply, HealthCall, ResultReply, RpcCall
from radixserve.router.runtime import RouterRuntime
from tests.router.conftest import fleet_secret, start_replicas, stop_all, system_prompt
from tests.server.survival import assert_survived, baseline

KEYS = ["sk-alice=alice", "sk-bob=bob"]
ADMIN = "sk-fleet-admin"
GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def fleet(tiny):
    replicas = start_replicas(tiny, 2, api_key=KEYS, admin_api_key=ADMIN)
    try:
        with RouterRuntime(replica=[r.rpc_address for r in replicas], api_key=KEYS,
                           admin_api_key=ADMIN, cache_secret_file=fleet_secret()) as rt:
            yield rt
    finally:
        stop_all(replicas)


@pytest.fixture(scope="module")
def operator(fleet):
    with Client(fleet.rpc_address, api_key=ADMIN, timeout=120) as c:
        yield c


def test_tenants_through_the_router(fleet, operator):
    with Client(fleet.rpc_address, api_key="sk-alice", timeout=120) as alice, \
            Client(fleet.rpc_address, api_key="sk-bob", timeout=120) as bob, \
            Client(fleet.rpc_address, api_key="sk-mallory", timeout=120) as mallory:
        prompt = system_prompt(40) + "Secret question?\n"
        first = alice.generate(prompt, GREEDY)
        again = alice.generate(prompt, GREEDY)
        assert again["meta_info"]["cached_tokens"] > 0
        assert again["meta_info"]["replica"] == first["meta_info"]["replica"]
        # The router hashed the prompt as the replica did (shared secret) and took the
        # replica's snapshot and events with the replicas' operator key.
        assert operator.workers()["routed_by_reason"].get("cache_hit") == 1
        theirs = bob.generate(prompt, GREEDY)
        assert theirs["meta_info"]["cached_tokens"] == 0, "bob never gets alice's prefix"
        assert theirs["output_ids"] == first["output_ids"]
        salted = alice.generate(prompt, GREEDY, cache_salt="other")
        assert salted["meta_info"]["cached_tokens"] == 0
        with pytest.raises(ServerError) as refused:
            mallory.generate(prompt, GREEDY)
        assert refused.value.code == "unauthorized"
        # The router's HTTP API checks the bearer key as a server's does.
        url = fleet.http_url + "/generate"
        body = {"text": prompt, "sampling_params": GREEDY}
        assert httpx.post(url, json=body, timeout=60).status_code == 401
        ok = httpx.post(url, json=body, timeout=60,
                        headers={"Authorization": "Bearer sk-alice"})
        assert ok.status_code == 200 and ok.json()["meta_info"]["cached_tokens"] > 0


def test_fleet_changes_are_the_operators(fleet, operator):
    """Issue 25, class 6: a tenant can neither add a worker of its own choosing (which would
    then get other tenants' prompts and keys) nor list, remove or flush them."""
    with Client(fleet.rpc_address, api_key="sk-alice", timeout=60) as alice:
        before = baseline(alice)
        for call in (lambda: alice.workers("add", "tcp://127.0.0.1:9"),
                     lambda: alice.workers("remove", fleet_urls(operator)[0]),
                     alice.workers, alice.flush_cache, alice.cache_snapshot,
                     alice.start_profile):
            with pytest.raises(ServerError) as refused:
                call()
            assert refused.value.code == "forbidden", refused.value
            assert "--admin-api-key" in refused.value.message
        auth = {"Authorization": "Bearer sk-alice"}
        for method, path in (("POST", "/add_worker?url=tcp://127.0.0.1:9"),
                             ("POST", "/remove_worker?url=tcp://127.0.0.1:9"),
                             ("GET", "/list_workers"), ("POST", "/flush_cache")):
            r = httpx.request(method, fleet.http_url + path, headers=auth, timeout=30)
            assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", r.text
        assert len(fleet_urls(operator)) == 2  # nothing was added or removed
        assert_survived(alice, before, operator=operator)


def fleet_urls(operator: Client) -> list[str]:
    return [w["url"] for w in operator.workers()["workers"]]


def test_a_rogue_replicas_replies_to_other_calls_are_dropped(fleet, operator):
    """Issue 25, class 6: a worker that answers calls the router sent to another replica
    (link ids are sequential: easy to guess) reaches no client."""
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.ROUTER)
    rogue.setsockopt(zmq.LINGER, 0)
    port = rogue.bind_to_random_port("tcp://127.0.0.1")
    url = f"tcp://127.0.0.1:{port}"
    stop = threading.Event()
    sprayed: list[int] = []

    def spray() -> None:
        """Answer no call of its own (it never becomes routable), and for every health
        check it gets, answer the ids around it: results and chunks of other calls."""
        decoder = msgspec.msgpack.Decoder(RpcCall)
        encoder = msgspec.msgpack.Encoder()
        while not stop.is_set():
            if not rogue.poll(50):
                continue
            peer, frame = rogue.recv_multipart()
            call = decoder.decode(frame)
            if not isinstance(call, HealthCall):
                continue
            for i in range(max(1, call.call_id - 100), call.call_id + 100):
                for reply in (ChunkReply(i, 0, "ROGUE", [1]),
                              ResultReply(i, {"text": "ROGUE", "meta_info": {}}),
                              ErrorReply(i, "invalid_request", "ROGUE")):
                    rogue.send_multipart([peer, encoder.encode(reply)])
            sprayed.append(call.call_id)

    thread = threading.Thread(target=spray, daemon=True)
    thread.start()
    try:
        with Client(fleet.rpc_address, api_key="sk-alice", timeout=120) as alice:
            before = baseline(alice)
            assert operator.workers("add", url) == {"added": url}
            # Long enough to be in flight across several of the rogue's health checks.
            params = {**GREEDY, "max_new_tokens": 64}
            reference = alice.generate("Tell me about rivers.", params)
            for _ in range(3):
                chunks = list(alice.generate("Tell me about rivers.", params, stream=True))
                assert all("ROGUE" not in str(c) for c in chunks), chunks
                assert chunks[-1]["final"]["output_ids"] == reference["output_ids"]
                out = alice.generate("Tell me about rivers.", params)
                assert out["output_ids"] == reference["output_ids"] and "ROGUE" not in str(out)
            assert len(sprayed) >= 2, "the rogue replica was never asked anything"
            assert operator.workers("remove", url) == {"removed": url}
            assert_survived(alice, before, operator=operator)
    finally:
        stop.set()
        thread.join(5)
        ctx.destroy(linger=0)
