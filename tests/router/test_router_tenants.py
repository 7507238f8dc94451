"""API keys through the router: it checks callers as a server does, routes within each
tenant's namespace, and a tenant never gets another's cached prefix through it."""

from __future__ import annotations

import httpx
import pytest

from radixserve.client import Client, ServerError
from radixserve.router.runtime import RouterRuntime
from tests.router.conftest import assert_replicas_idle, start_replicas, stop_all, system_prompt

KEYS = ["sk-alice=alice", "sk-bob=bob"]
GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


def test_tenants_through_the_router(tiny):
    replicas = start_replicas(tiny, 2, api_key=KEYS)
    try:
        with RouterRuntime(replica=[r.rpc_address for r in replicas], api_key=KEYS) as rt, \
                Client(rt.rpc_address, api_key="sk-alice", timeout=120) as alice, \
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
        assert_replicas_idle(replicas, api_key="sk-alice")
    finally:
        stop_all(replicas)
