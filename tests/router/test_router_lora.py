"""LoRA adapters through the router: a generate call's `lora_name` reaches the replica as
sent (the answer is PEFT's), a load and an unload reach every replica (the operator's
only), the list is what every replica has, and OpenAI's `model` names an adapter through
the router's own HTTP app."""

from __future__ import annotations

import httpx
import pytest

from radixserve.client import Client, ServerError
from radixserve.router.runtime import RouterRuntime
from tests.lora.adapters import peft_adapter, peft_greedy
from tests.router.conftest import (assert_replicas_idle, fleet_secret, start_replicas,
                                  stop_all)

KEYS = ["sk-lora-alice=alice"]
ADMIN = "sk-lora-fleet-admin"
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
IDS = [301 + 37 * i % 9000 for i in range(24)]


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    root = tmp_path_factory.getbasetemp() / "lora-adapters"
    return {"qv": peft_adapter(tiny, root, rank=8, alpha=16, scale=30.0),
            "mlp": peft_adapter(tiny, root, rank=16, alpha=4, scale=30.0, seed=2,
                                targets=("gate_proj", "down_proj"))}


@pytest.fixture(scope="module")
def fleet(tiny, adapters):
    replicas = start_replicas(tiny, 2, api_key=KEYS, admin_api_key=ADMIN,
                              max_total_tokens=2048, lora_paths=[f"qv={adapters['qv']}"],
                              max_lora_rank=16, lora_target_modules=["all"])
    try:
        with RouterRuntime(replica=[r.rpc_address for r in replicas], api_key=KEYS,
                           admin_api_key=ADMIN, cache_secret_file=fleet_secret()) as rt:
            yield rt, replicas
        assert_replicas_idle(replicas, api_key=ADMIN)
    finally:
        stop_all(replicas)


def test_adapters_through_the_router(fleet, tiny, adapters):
    rt, replicas = fleet
    with Client(rt.rpc_address, api_key="sk-lora-alice", timeout=120) as alice, \
            Client(rt.rpc_address, api_key=ADMIN, timeout=120) as operator:
        out = alice.generate(input_ids=IDS, sampling_params=GREEDY, lora_name="qv")
        assert out["output_ids"] == peft_greedy(tiny, adapters["qv"], IDS, 6)
        with pytest.raises(ServerError) as refused:
            alice.load_lora_adapter("mlp", str(adapters["mlp"]))
        assert refused.value.code == "forbidden"
        loaded = operator.load_lora_adapter("mlp", str(adapters["mlp"]))
        assert loaded["name"] == "mlp" and loaded["rank"] == 16
        for replica in replicas:  # on every replica
            with Client(replica.rpc_address, api_key=ADMIN, timeout=60) as direct:
                assert [a["name"] for a in direct.list_lora_adapters()] == ["qv", "mlp"]
        listed = alice.list_lora_adapters()
        assert [a["name"] for a in listed] == ["qv", "mlp"] and listed[0]["path"] is None
        assert operator.list_lora_adapters()[1]["path"] == str(adapters["mlp"])
        want = peft_greedy(tiny, adapters["mlp"], IDS, 6)
        for _ in range(2):  # whichever replica the router picks
            got = alice.generate(input_ids=IDS, sampling_params=GREEDY, lora_name="mlp")
            assert got["output_ids"] == want
        with httpx.Client(base_url=rt.http_url, timeout=120,
                          headers={"Authorization": "Bearer sk-lora-alice"}) as http:
            models = [m["id"] for m in http.get("/v1/models").json()["data"]]
            assert models[1:] == ["qv", "mlp"]
            r = http.post("/v1/completions", json={"model": "mlp", "prompt": IDS,
                                                   "max_tokens": 6, "temperature": 0,
                                                   "ignore_eos": True})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == got["text"]
        operator.unload_lora_adapter("mlp")
        with pytest.raises(ServerError, match="unknown LoRA adapter 'mlp'"):
            alice.generate(input_ids=IDS, lora_name="mlp")
        with pytest.raises(ServerError, match="unknown LoRA adapter 'mlp'"):
            operator.unload_lora_adapter("mlp")  # a replica's refusal is the answer
        assert [a["name"] for a in alice.list_lora_adapters()] == ["qv"]
