"""Tenant isolation of the prefix cache (issue 14), over HTTP and RPC, on a server of its
own (several API keys, a small pool, a tiny random-weight model with the real tokenizer).

A tenant never gets `cached_tokens` (nor the saved prefill) from another tenant's
prompts; `cache_salt` splits one tenant's cache further; no key or salt reaches another
tenant's namespace; a wrong key is a 401 (HTTP) or `unauthorized` (RPC). "Cold" is checked
by the scheduler's `prefill_tokens` counter, not by timing: the whole prompt is computed.
"""

from __future__ import annotations

import random
import threading

import httpx
import pytest

from radixserve.client import Client, ServerError
from radixserve.server.runtime import Runtime
from tests.factories import tiny_model_dir
from tests.server.conftest import assert_server_idle

KEY_A, KEY_B, KEY_D = "sk-tenant-a", "sk-tenant-b==", "sk-default"
PROMPT_LEN = 500
HIT = (PROMPT_LEN - 1) // 16 * 16  # all whole pages but the last token's


@pytest.fixture(scope="module")
def tenant_runtime(tmp_path_factory):
    tiny = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")
    keys_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys_file.write_text(f"# key tenant\n{KEY_B} tenant-b\n\n")
    with Runtime(str(tiny), max_total_tokens=4096, debug_invariants=True,
                 api_key=[f"{KEY_A}=tenant-a", KEY_D], api_keys_file=str(keys_file),
                 schedule_policy="lpm") as rt:
        yield rt
        assert_server_idle(rt, api_key=KEY_D)


@pytest.fixture(scope="module")
def admin(tenant_runtime):
    with Client(tenant_runtime.rpc_address, timeout=120, api_key=KEY_D) as c:
        yield c


@pytest.fixture(scope="module")
def http(tenant_runtime):
    with httpx.Client(base_url=tenant_runtime.http_url, timeout=120) as c:
        yield c


_seeds = iter(range(1000, 100000))


def prompt() -> list[int]:
    """A fresh ~500-token prompt per call, so tests do not see each other's caches."""
    rng = random.Random(next(_seeds))
    return [rng.randrange(300, 20000) for _ in range(PROMPT_LEN)]


def generate(http: httpx.Client, key: str, ids: list[int], **extra) -> dict:
    r = http.post("/generate", headers={"Authorization": f"Bearer {key}"},
                  json={"input_ids": ids, "sampling_params": {"max_new_tokens": 2,
                                                              "temperature": 0}, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def cold(admin: Client, run) -> tuple[int, int]:
    """(cached_tokens, tokens prefilled) of one request."""
    before = admin.stats()["prefill_tokens"]
    out = run()
    return out["meta_info"]["cached_tokens"], admin.stats()["prefill_tokens"] - before


def test_other_tenant_gets_no_hit_and_a_cold_prefill(http, admin) -> None:
    ids = prompt()
    assert cold(admin, lambda: generate(http, KEY_A, ids)) == (0, PROMPT_LEN)
    # B sends A's prompt: nothing cached for B, the whole prompt is computed.
    assert cold(admin, lambda: generate(http, KEY_B, ids)) == (0, PROMPT_LEN)
    # The default tenant (a bare key) is a tenant of its own too.
    assert cold(admin, lambda: generate(http, KEY_D, ids)) == (0, PROMPT_LEN)
    # A's repeat hits its own cache and computes only the rest.
    assert cold(admin, lambda: generate(http, KEY_A, ids)) == (HIT, PROMPT_LEN - HIT)
    assert cold(admin, lambda: generate(http, KEY_B, ids))[0] == HIT


def test_cache_salt_splits_one_tenants_cache(http, admin) -> None:
    ids = prompt()
    generate(http, KEY_A, ids)
    assert cold(admin, lambda: generate(http, KEY_A, ids, cache_salt="s1")) == (0, PROMPT_LEN)
    assert cold(admin, lambda: generate(http, KEY_A, ids, cache_salt="s1"))[0] == HIT
    assert cold(admin, lambda: generate(http, KEY_A, ids, cache_salt="s2"))[0] == 0
    assert cold(admin, lambda: generate(http, KEY_A, ids))[0] == HIT  # unsalted: still there


def test_the_same_salt_never_reaches_another_tenant(http, admin) -> None:
    ids = prompt()
    generate(http, KEY_A, ids, cache_salt="shared-salt")
    assert generate(http, KEY_A, ids, cache_salt="shared-salt")["meta_info"]["cached_tokens"] == HIT
    # B passing A's salt still misses: the namespace is (B's tenant, salt), not the salt.
    for salt in ("shared-salt", None, "tenant-a"):
        extra = {} if salt is None else {"cache_salt": salt}
        assert cold(admin, lambda: generate(http, KEY_B, ids, **extra)) == (0, PROMPT_LEN)


def test_openai_routes_take_cache_salt_and_are_isolated(http) -> None:
    text = " ".join(f"word{i}" for i in range(300))

    def complete(key: str, **extra) -> int:
        r = http.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": "default", "prompt": text, "max_tokens": 1,
                            "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def chat(key: str, **extra) -> int:
        r = http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": "default", "max_tokens": 1, "temperature": 0,
                            "messages": [{"role": "user", "content": text}], **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    for call in (complete, chat):
        assert call(KEY_A, cache_salt="oa") == 0
        assert call(KEY_A, cache_salt="oa") > 0
        assert call(KEY_B, cache_salt="oa") == 0
        assert call(KEY_A) == 0


def test_wrong_or_missing_key_is_401(http) -> None:
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}}
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {KEY_A}"},
                    {"Authorization": f"Bearer {KEY_A}x"}, {"Authorization": "Bearer tenant-a"}):
        r = http.post("/generate", json=body, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert http.get("/metrics", headers=headers).status_code == 401
    assert http.get("/health").status_code == 200  # open for load balancers
    assert generate(http, KEY_B, [5, 6, 7])["meta_info"]["finish_reason"] is not None


def test_rpc_tenant_tokens(tenant_runtime, http, admin) -> None:
    ids = prompt()
    address = tenant_runtime.rpc_address
    with Client(address, timeout=120, api_key=KEY_A) as a, \
            Client(address, timeout=120, api_key=KEY_B) as b:
        sp = {"max_new_tokens": 2, "temperature": 0}
        assert a.generate(input_ids=ids, sampling_params=sp)["meta_info"]["cached_tokens"] == 0
        assert cold(admin, lambda: b.generate(input_ids=ids, sampling_params=sp)) == (0, PROMPT_LEN)
        # A over HTTP is the same tenant as A over RPC: one namespace.
        assert generate(http, KEY_A, ids)["meta_info"]["cached_tokens"] == HIT
        # cache_salt over RPC, and B cannot reach A's salted namespace either.
        assert a.generate(input_ids=ids, sampling_params=sp, cache_salt="r")[
            "meta_info"]["cached_tokens"] == 0
        assert a.generate(input_ids=ids, sampling_params=sp, cache_salt="r")[
            "meta_info"]["cached_tokens"] == HIT
        assert b.generate(input_ids=ids, sampling_params=sp, cache_salt="r")[
            "meta_info"]["cached_tokens"] == 0
        with pytest.raises(ServerError, match="cache_salt"):
            a.generate(input_ids=ids, sampling_params=sp, cache_salt="")
        beams = lambda c: c.beam_search(input_ids=ids, beam_width=2, max_new_tokens=2,  # noqa
                                        cache_salt="beam")[0]["meta_info"]["cached_tokens"]
        assert beams(a) == 0 and beams(a) == HIT and beams(b) == 0
    for key in (None, "wrong", KEY_A + "x"):
        with Client(address, timeout=30, api_key=key) as c:
            for call in (lambda: c.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 1}),
                         c.stats, c.flush_cache, c.model_info, lambda: c.abort("x")):
                with pytest.raises(ServerError) as err:
                    call()
                assert err.value.code == "unauthorized"
            assert c.health()["status"] == "ok"  # open, as /health is


def test_a_tenant_cannot_abort_anothers_request(tenant_runtime) -> None:
    address = tenant_runtime.rpc_address
    with Client(address, timeout=120, api_key=KEY_A) as a, \
            Client(address, timeout=120, api_key=KEY_B) as b:
        result: dict = {}
        sp = {"max_new_tokens": 150, "ignore_eos": True, "temperature": 0}
        chunks = a.generate(input_ids=[7, 8, 9], sampling_params=sp, rid="a-long", stream=True)
        first = next(chunks)  # running now
        assert "index" in first
        assert b.abort("a-long") == {"aborted": "a-long"}  # the same answer, and no effect

        def drain() -> None:
            for item in chunks:
                if "final" in item:
                    result.update(item["final"])
        t = threading.Thread(target=drain)
        t.start()
        t.join(120)
        assert result["meta_info"]["finish_reason"]["type"] == "length"
        # The owner can abort its own.
        chunks = a.generate(input_ids=[7, 8, 9], sampling_params=sp, rid="a-long2", stream=True)
        next(chunks)
        a.abort("a-long2")
        final = [item for item in chunks if "final" in item][0]["final"]
        assert final["meta_info"]["finish_reason"]["type"] == "abort"


def test_metrics_per_tenant(http) -> None:
    generate(http, KEY_B, [11, 12, 13])
    text = http.get("/metrics", headers={"Authorization": f"Bearer {KEY_A}"}).text
    for name in ("radixserve_tenant_requests_total", "radixserve_tenant_prompt_tokens_total",
                 "radixserve_tenant_cached_prompt_tokens_total",
                 "radixserve_tenant_generation_tokens_total"):
        assert f'{name}{{tenant="tenant-b"}}' in text, name
    assert 'radixserve_tenant_requests_total{tenant="tenant-a"}' in text
    assert 'tenant="default"' in text


def test_blocks_all_free_after_flush(admin) -> None:
    assert admin.flush_cache() == {"flushed": True}
    s = admin.stats()
    assert s["running"] == 0 and s["waiting"] == 0
    assert s["free_blocks"] == s["num_blocks"], s
