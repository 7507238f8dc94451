"""API keys through the router: it checks callers as a server does, routes within each
tenant's namespace, and a tenant never gets another's cached prefix through it; rids are
scoped by tenant, and every abort reaches its caller's own requests only. The operator's
calls need the operator key, and a reply is taken only from the replica its call went to
(issue 25, classes 6 and 7)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import msgspec
import pytest
import zmq

from radixserve.client import Client, ServerError
from radixserve.messages import (ChunkReply, ErrorReply, GenerateCall, HealthCall,
                                 ResultReply, RpcCall)
from radixserve.results.generate import CachedTokens, GenerateOutput, GenerateResult
from radixserve.router.runtime import RouterRuntime
from tests.router.conftest import (assert_replicas_idle, fleet_secret, start_replicas,
                                  stop_all, system_prompt)
from tests.server.conftest import stream_when_free
from tests.server.survival import assert_survived, baseline

KEYS = ["sk-alice=alice", "sk-bob=bob"]
ADMIN = "sk-fleet-admin"
GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
LONG = {"temperature": 0, "max_new_tokens": 1500, "ignore_eos": True}
"""Alice's stream: long enough to outlive every attack (checked, not assumed)."""
BOB = {"Authorization": "Bearer sk-bob"}


@pytest.fixture(scope="module")
def fleet(tiny):
    """Two replicas with alice's and bob's keys and an operator key, and a router with
    the same keys and the replicas' cache secret."""
    replicas = start_replicas(tiny, 2, api_key=KEYS, admin_api_key=ADMIN,
                              max_total_tokens=4096)
    try:
        with RouterRuntime(replica=[r.rpc_address for r in replicas], api_key=KEYS,
                           admin_api_key=ADMIN, cache_secret_file=fleet_secret()) as rt:
            yield rt, replicas
        assert_replicas_idle(replicas, api_key=ADMIN)
    finally:
        stop_all(replicas)


@pytest.fixture(scope="module")
def operator(fleet):
    with Client(fleet[0].rpc_address, api_key=ADMIN, timeout=120) as c:
        yield c


def test_tenants_through_the_router(fleet, operator):
    rt, _ = fleet
    with Client(rt.rpc_address, api_key="sk-alice", timeout=120) as alice, \
            Client(rt.rpc_address, api_key="sk-bob", timeout=120) as bob, \
            Client(rt.rpc_address, api_key="sk-mallory", timeout=120) as mallory:
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


def test_rids_are_scoped_by_tenant_through_the_router(fleet, operator):
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
        chunks = stream_when_free(bob, "shared", input_ids=[9, 8, 7], sampling_params=LONG)
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
        assert_survived(alice, before, operator=operator)
        for replica in replicas:
            with Client(replica.rpc_address, api_key="sk-alice", timeout=120) as direct, \
                    Client(replica.rpc_address, api_key=ADMIN, timeout=120) as admin:
                assert_survived(direct, baseline(direct), operator=admin)


def test_fleet_changes_are_the_operators(fleet, operator):
    rt, _ = fleet
    """Issue 25, class 6: a tenant can neither add a worker of its own choosing (which would
    then get other tenants' prompts and keys) nor list, remove or flush them."""
    with Client(rt.rpc_address, api_key="sk-alice", timeout=60) as alice:
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
            r = httpx.request(method, rt.http_url + path, headers=auth, timeout=30)
            assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", r.text
        assert len(fleet_urls(operator)) == 2  # nothing was added or removed
        assert_survived(alice, before, operator=operator)


def fleet_urls(operator: Client) -> list[str]:
    return [w["url"] for w in operator.workers()["workers"]]


def test_a_rogue_replicas_replies_to_other_calls_are_dropped(fleet, operator):
    rt, _ = fleet
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
            peer, *_, frame = rogue.recv_multipart()  # [peer, envelope, call]
            call = decoder.decode(frame)
            if not isinstance(call, HealthCall):
                continue
            for i in range(max(1, call.call_id - 100), call.call_id + 100):
                # A generate result first, for its own health check too: the router must
                # take that as an error, not read it as a control call's answer.
                for reply in (ResultReply(i, GenerateResult([GenerateOutput(
                                  id="rogue", text="ROGUE", output_ids=[1],
                                  finish_reason=None, prompt_tokens=1, completion_tokens=1,
                                  cached_tokens=0, cached_tokens_details=CachedTokens())],
                                  single=True)),
                              ChunkReply(i, 0, "ROGUE", [1]),
                              ErrorReply(i, "invalid_request", "ROGUE")):
                    rogue.send_multipart([peer, encoder.encode(reply)])
            sprayed.append(call.call_id)

    thread = threading.Thread(target=spray, daemon=True)
    thread.start()
    try:
        with Client(rt.rpc_address, api_key="sk-alice", timeout=120) as alice:
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
