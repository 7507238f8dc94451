"""LoRA adapters through every surface of a real server (issue 46), on one server for the
module: a tiny random-weight model with two tenants and an operator key, serving an
adapter from the start (`--lora-paths`) and loading others at run time.

Greedy output under an adapter is transformers + PEFT's (tests/lora/adapters.py) over
RPC (`Client`, `AsyncClient`), `/generate`, the `openai` client (`model` = the adapter)
and the DSL; `/v1/models` lists the adapters; a load over HTTP is served at once and an
unload refused by name after; the cache is keyed by adapter, by the adapter's weights
(a different file reloaded under a name reuses no KV) and by tenant. Attacks: a tenant's
load and unload are `forbidden`; bad adapter directories, names, paths and `lora_name`
(SGLang's `lora_path` on /generate) lists are 400s naming the problem and the field as the
caller named it, after which the server is the same server, answering the same, with every
KV block free."""

from __future__ import annotations

import asyncio
import json
import random
import shutil

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from radixserve.client import AsyncClient, Client, ServerError
from radixserve.server.runtime import Runtime
from tests.conftest import require
from tests.factories import tiny_model_dir
from tests.lora.adapters import peft_adapter, peft_greedy
from tests.server.conftest import assert_server_idle
from tests.server.survival import assert_survived, baseline

KEY_A, KEY_B, ADMIN = "sk-lora-tenant-a", "sk-lora-tenant-b", "sk-lora-operator"
SERVED = "tiny-base"
MAX_NEW = 8
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
MAX_RANK = 16


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    """PEFT's own adapters for the tiny model (B scaled up, so each changes the answer)."""
    root = tmp_path_factory.getbasetemp() / "lora-adapters"
    return {"qv": peft_adapter(tiny, root, rank=8, alpha=16, scale=30.0),
            "all": peft_adapter(tiny, root, rank=4, alpha=8, scale=30.0, targets=(
                "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
            "mlp": peft_adapter(tiny, root, rank=16, alpha=4, scale=30.0, seed=2,
                                targets=("gate_proj", "down_proj"))}


@pytest.fixture(scope="module")
def server(tiny, adapters):
    with Runtime(str(tiny), max_total_tokens=4096, debug_invariants=True, page_size=4,
                 served_model_name=SERVED, api_key=[f"{KEY_A}=tenant-a", f"{KEY_B}=tenant-b"],
                 admin_api_key=ADMIN, lora_paths=[f"qv={adapters['qv']}"],
                 max_lora_rank=MAX_RANK, lora_target_modules=["all"], max_loras_per_batch=2,
                 max_loaded_loras=3) as rt:
        yield rt
        assert_server_idle(rt.rpc_address, api_key=ADMIN)


@pytest.fixture(scope="module")
def admin(server):
    with Client(server.rpc_address, timeout=120, api_key=ADMIN) as c:
        yield c


@pytest.fixture(scope="module")
def tenant(server):
    with Client(server.rpc_address, timeout=120, api_key=KEY_A) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def openai_client(server):
    openai = require("openai")
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=KEY_A, max_retries=0)


_seeds = iter(range(4600, 10**6))


def prompt(n: int = 40) -> list[int]:
    """Fresh token ids per call, so tests do not see each other's caches."""
    rng = random.Random(next(_seeds))
    return [rng.randrange(300, 20000) for _ in range(n)]


def post(http: httpx.Client, path: str, body: dict, key: str = ADMIN) -> httpx.Response:
    return http.post(path, json=body, headers=bearer(key))


def error_of(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    for word in words:
        assert word in error["message"], (word, error)
    return error


def test_greedy_under_an_adapter_is_peft_s_on_every_surface(server, tiny, adapters, tenant,
                                                          http, openai_client):
    ids = prompt()
    want = peft_greedy(tiny, adapters["qv"], ids, MAX_NEW)
    base = peft_greedy(tiny, None, ids, MAX_NEW)
    assert want != base
    rpc = tenant.generate(input_ids=ids, sampling_params=GREEDY, lora_name="qv")
    assert rpc["output_ids"] == want
    both = tenant.generate(input_ids=[ids, ids], sampling_params=GREEDY, lora_name=[None, "qv"])
    assert [o["output_ids"] for o in both] == [base, want]

    async def aio() -> dict:
        async with AsyncClient(server.rpc_address, timeout=120, api_key=KEY_A) as c:
            return await c.generate(input_ids=ids, sampling_params=GREEDY, lora_name="qv")
    assert asyncio.run(aio())["output_ids"] == want

    for field in ("lora_path", "lora_name", "model"):  # SGLang's, radixserve's, a router's
        r = post(http, "/generate", {"input_ids": ids, "sampling_params": GREEDY,
                                     field: "qv"}, KEY_A)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == want
    out = openai_client.completions.create(model="qv", prompt=ids, max_tokens=MAX_NEW,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].text == rpc["text"] and out.model == "qv"
    sglang = openai_client.completions.create(  # SGLang's extension names the adapter
        model=SERVED, prompt=ids, max_tokens=MAX_NEW, temperature=0,
        extra_body={"ignore_eos": True, "lora_path": "qv"})
    assert sglang.choices[0].text == rpc["text"]
    r = post(http, "/v1/completions", {"model": SERVED, "prompt": "x", "lora_path": "nope"},
             KEY_A)
    assert r.status_code == 404 and "'nope'" in r.text and r.json()["error"]["param"] == "lora_path"
    plain = openai_client.completions.create(model=SERVED, prompt=ids, max_tokens=MAX_NEW,
                                             temperature=0, extra_body={"ignore_eos": True})
    assert plain.choices[0].text == both[0]["text"]


def test_chat_under_an_adapter(server, tiny, tenant, openai_client):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "Name a colour."}]
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                         tokenize=False))
    want = tenant.generate(input_ids=ids, sampling_params=GREEDY, lora_name="qv")["text"]
    chat = openai_client.chat.completions.create(model="qv", messages=messages,
                                                 max_tokens=MAX_NEW, temperature=0,
                                                 extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == want


def test_models_lists_the_base_and_each_adapter(server, adapters, openai_client):
    openai = require("openai")
    cards = openai_client.models.list().data
    assert [c.id for c in cards] == [SERVED, "qv"]
    assert cards[1].parent == SERVED and cards[1].root is None  # a tenant sees no paths
    operator = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=ADMIN, max_retries=0)
    card = operator.models.retrieve("qv")
    assert card.root == str(adapters["qv"]) and card.parent == SERVED
    with pytest.raises(openai.NotFoundError) as missing:
        openai_client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    error = missing.value.body
    assert error["code"] == "model_not_found" and SERVED in error["message"]
    assert "'qv'" in error["message"]


def test_load_over_http_serve_it_unload_it(server, tiny, adapters, http, tenant, admin,
                                          openai_client):
    openai = require("openai")
    before = baseline(tenant)
    r = post(http, "/load_lora_adapter", {"lora_name": "mlp", "lora_path": str(adapters["mlp"])})
    assert r.status_code == 200, r.text
    loaded = r.json()
    assert loaded["success"] and loaded["name"] == "mlp" and loaded["rank"] == 16
    assert loaded["target_modules"] == ["down_proj", "gate_proj"] and loaded["unloaded"] == []
    assert loaded["path"] == str(adapters["mlp"])
    ids = prompt()
    out = openai_client.completions.create(model="mlp", prompt=ids, max_tokens=MAX_NEW,
                                           temperature=0, extra_body={"ignore_eos": True})
    rpc = tenant.generate(input_ids=ids, sampling_params=GREEDY, lora_name="mlp")
    assert rpc["output_ids"] == peft_greedy(tiny, adapters["mlp"], ids, MAX_NEW)
    assert out.choices[0].text == rpc["text"]
    listed = http.get("/lora_adapters", headers=bearer(KEY_A)).json()["loras"]
    assert {a["name"] for a in listed} == {"qv", "mlp"} and {a["path"] for a in listed} == {None}
    assert [c.id for c in openai_client.models.list().data] == [SERVED, "qv", "mlp"]

    r = post(http, "/v1/unload_lora_adapter", {"lora_name": "mlp"})
    assert r.status_code == 200 and r.json() == {"success": True, "unloaded": "mlp"}, r.text
    with pytest.raises(openai.NotFoundError) as gone:
        openai_client.completions.create(model="mlp", prompt=ids, max_tokens=1)
    assert "'qv'" in gone.value.body["message"]
    error_of(post(http, "/generate", {"input_ids": ids, "lora_path": "mlp"}, KEY_A), 400,
             "unknown LoRA adapter 'mlp'", "loaded: qv")
    with pytest.raises(ServerError, match="unknown LoRA adapter 'mlp'"):
        tenant.generate(input_ids=ids, lora_name="mlp")
    error_of(post(http, "/unload_lora_adapter", {"lora_name": "mlp"}), 400,
             "unknown LoRA adapter 'mlp'")
    assert_survived(tenant, before, admin)


def test_the_cache_is_keyed_by_adapter_weights_and_tenant(server, adapters, admin, tenant):
    """The same prompt under two adapters shares no KV, under one it does; a different
    file reloaded under a name reuses none of the old one's; another tenant's KV under the
    same adapter is never shared."""
    admin.load_lora_adapter("all", str(adapters["all"]))
    ids = prompt(48)
    params = {"max_new_tokens": 2, "temperature": 0}

    def cached(client: Client, lora: str | None) -> int:
        out = client.generate(input_ids=ids, sampling_params=params, lora_name=lora)
        return out["meta_info"]["cached_tokens"]

    assert [cached(tenant, a) for a in ("qv", "all", None)] == [0, 0, 0]
    assert cached(tenant, "qv") >= 44 and cached(tenant, "all") >= 44
    with Client(server.rpc_address, timeout=120, api_key=KEY_B) as other:
        assert cached(other, "qv") == 0  # tenant-b: none of tenant-a's KV under qv
        assert cached(other, "qv") >= 44
    admin.unload_lora_adapter("all")
    assert admin.load_lora_adapter("all", str(adapters["mlp"]))["name"] == "all"
    assert cached(tenant, "all") == 0  # other weights under the old name: no stale KV
    admin.unload_lora_adapter("all")
    admin.load_lora_adapter("again", str(adapters["all"]))
    assert cached(tenant, "again") >= 44  # the same weights, whatever the name: their KV
    admin.unload_lora_adapter("again")
    assert [a["name"] for a in admin.list_lora_adapters()] == ["qv"]


def test_the_dsl_runs_a_program_under_an_adapter(server, tenant):
    import radixserve.lang as sgl
    from radixserve.lang.backends import RuntimeEndpoint

    @sgl.function
    def answer(s, question):
        s += "Q: " + question + "\nA:" + sgl.gen("a", max_tokens=MAX_NEW, ignore_eos=True)

    text = "Q: What is the sky?\nA:"
    backend = RuntimeEndpoint(server.rpc_address, timeout=120, api_key=KEY_A)
    try:
        for lora in ("qv", None):
            state = answer.run(question="What is the sky?", backend=backend, lora_name=lora,
                               temperature=0)
            want = tenant.generate(prompt=text, sampling_params=GREEDY, lora_name=lora)
            assert state["a"] == want["text"], lora
    finally:
        backend.shutdown()


# -- attacks -----------------------------------------------------------------------------

def test_a_tenant_cannot_load_or_unload(server, adapters, http, tenant, admin):
    before = baseline(tenant)
    for call in (lambda: tenant.load_lora_adapter("x", str(adapters["mlp"])),
                 lambda: tenant.unload_lora_adapter("qv")):
        with pytest.raises(ServerError) as refused:
            call()
        assert refused.value.code == "forbidden" and "--admin-api-key" in refused.value.message
    for path in ("/load_lora_adapter", "/v1/load_lora_adapter"):
        error = error_of(post(http, path, {"lora_name": "x", "lora_path": str(adapters["mlp"])},
                              KEY_B), 403, "--admin-api-key")
        assert error["code"] == "forbidden"
    for path in ("/unload_lora_adapter", "/v1/unload_lora_adapter"):
        error_of(post(http, path, {"lora_name": "qv"}, KEY_A), 403)
    assert [a["name"] for a in tenant.list_lora_adapters()] == ["qv"]
    assert tenant.list_lora_adapters()[0]["path"] is None
    assert_survived(tenant, before, admin)


def _bad_adapters(tiny, adapters, root) -> list[tuple[str, str, list[str]]]:
    """(name, directory, words the 400 names) for adapters that must be refused."""
    good = adapters["qv"]
    out = []

    def copy(name: str):
        where = root / name
        shutil.copytree(good, where)
        return where

    corrupt = copy("corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{junk")
    out.append(("corrupt", str(corrupt), ["not a readable safetensors"]))
    other_base = tiny_model_dir(root / "other-base", hidden_size=32, num_heads=2, num_kv_heads=1,
                                intermediate_size=64)
    out.append(("other", str(peft_adapter(other_base, root, rank=4)),
                ["another base model"]))
    out.append(("wide", str(peft_adapter(tiny, root, rank=32, alpha=32)),
                ["rank 32", "max_lora_rank (16)"]))
    odd = copy("odd-target")
    weights = load_file(odd / "adapter_model.safetensors")
    save_file({k.replace("q_proj", "qkv_proj"): v for k, v in weights.items()},
              odd / "adapter_model.safetensors")
    out.append(("odd", str(odd), ["'qkv_proj'", "not one of the model's projections"]))
    pickled = copy("pickled")
    (pickled / "adapter_model.safetensors").unlink()
    torch.save(weights, pickled / "adapter_model.bin")
    out.append(("pickled", str(pickled), ["pickle", "never loaded"]))
    dora = copy("dora")
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    out.append(("dora", str(dora), ["DoRA"]))
    out.append(("missing", str(root / "nowhere"), ["not a directory"]))
    out.append(("file", str(good / "adapter_config.json"), ["not a directory"]))
    out.append(("deep", "/" + "a" * 4000, ["cannot be read"]))
    out.append(("empty", str(root), ["no readable PEFT adapter config"]))
    return out


def test_bad_adapters_are_400s_naming_the_problem(server, tiny, adapters, http, tenant, admin,
                                                 tmp_path):
    before = baseline(tenant)
    for name, path, words in _bad_adapters(tiny, adapters, tmp_path):
        error = error_of(post(http, "/load_lora_adapter", {"lora_name": name, "lora_path": path}),
                         400, *words)
        assert error["code"] == "invalid_request", (name, error)
    for body, words in [
            ({"lora_name": "bad name", "lora_path": str(adapters["mlp"])}, ["lora_name"]),
            ({"lora_name": "../up", "lora_path": str(adapters["mlp"])}, ["lora_name"]),
            ({"lora_name": "x" * 129, "lora_path": str(adapters["mlp"])}, ["lora_name"]),
            ({"lora_name": SERVED, "lora_path": str(adapters["mlp"])}, ["base model"]),
            ({"lora_name": "default", "lora_path": str(adapters["mlp"])}, ["base model"]),
            ({"lora_name": "qv", "lora_path": str(adapters["mlp"])}, ["already loaded"]),
            ({"lora_name": "x", "lora_path": "a" * 5000}, ["lora_path"]),
            ({"lora_name": "x", "lora_path": ""}, ["lora_path"]),
            ({"lora_name": "x", "lora_path": str(adapters["mlp"]), "pinned": True}, ["pinned"]),
            ({"lora_name": "x"}, ["lora_path"]),
            ({"lora_name": 5, "lora_path": "x"}, ["lora_name"])]:
        error_of(post(http, "/load_lora_adapter", body), 400, *words)
    assert [a["name"] for a in tenant.list_lora_adapters()] == ["qv"]
    assert_survived(tenant, before, admin)


def test_bad_lora_path_arguments_refuse_the_call_before_any_work(server, http, tenant, admin):
    before = baseline(tenant)
    ids = prompt(8)
    steps = admin.stats()["steps"]
    for body, words in [
            ({"input_ids": [ids, ids], "lora_path": ["qv", None, "qv"]},
             ["lora_path must", "per prompt (2)"]),
            ({"input_ids": [ids, ids, ids], "lora_path": [None, "qv", "nope"]},
             ["lora_path[2]", "unknown LoRA adapter 'nope'", "loaded: qv"]),
            ({"input_ids": ids, "lora_path": "x" * 129}, ["lora_path"]),
            ({"input_ids": ids, "lora_path": 5}, ["lora_path"]),
            ({"input_ids": ids, "lora_path": [["qv"]]}, ["lora_path"]),
            ({"text": "hi", "lora_path": SERVED}, ["unknown LoRA adapter"]),
            ({"input_ids": [ids, ids], "lora_name": ["qv", None, "qv"]},
             ["lora_name must", "per prompt (2)"]),
            ({"input_ids": [ids, ids, ids], "lora_name": [None, "qv", "nope"]},
             ["lora_name[2]", "unknown LoRA adapter 'nope'"]),
            ({"input_ids": ids, "lora_name": 5}, ["lora_name"]),
            ({"input_ids": ids, "lora_name": "qv", "lora_path": "qv"}, ["not both"])]:
        error_of(post(http, "/generate", body, KEY_A), 400, *words)
    with pytest.raises(ServerError, match=r"lora_name\[1\]: unknown LoRA adapter 'nope'"
                       ) as refused:
        tenant.generate(input_ids=[ids, ids], lora_name=["qv", "nope"])
    assert refused.value.code == "invalid_request"
    assert admin.stats()["steps"] == steps  # nothing of those calls ran
    assert_survived(tenant, before, admin)


def test_vllm_metrics_name_the_adapters_in_use(server, tenant, http):
    """vLLM's gauges, as an endpoint picker scrapes them with the operator's key: a request
    running under `qv` is running, holds KV, and is in `running_lora_adapters`; a tenant's
    scrape has the gauges but not the adapters every tenant's requests use."""
    chunks = tenant.generate(input_ids=prompt(), sampling_params={**GREEDY, "max_new_tokens":
                             1500}, lora_name="qv", stream=True, rid="vllm-metrics")
    next(chunks)
    text = http.get("/metrics", headers=bearer(ADMIN)).text
    tenants_view = http.get("/metrics", headers=bearer(KEY_A)).text
    tenant.abort("vllm-metrics")
    assert ('vllm:lora_requests_info{max_lora="2",running_lora_adapters="qv",'
            'waiting_lora_adapters=""}') in text
    assert "vllm:num_requests_running 1.0" in text and "vllm:num_requests_waiting 0.0" in text
    usage = [float(line.split()[1]) for line in text.splitlines()
             if line.startswith("vllm:kv_cache_usage_perc ")]
    assert len(usage) == 1 and 0 < usage[0] < 1
    assert "vllm:num_requests_running" in tenants_view
    assert "vllm:lora_requests_info{" not in tenants_view
