"""Tenant isolation of the prefix cache (issue 14), over HTTP and RPC, on the package's
tenant server (conftest: several API keys, an operator key, a small pool, a tiny
random-weight model with the real tokenizer).

A tenant never gets `cached_tokens` (nor the saved prefill) from another tenant's
prompts; `cache_salt` splits one tenant's cache further; no key or salt reaches another
tenant's namespace; a wrong key is a 401 (HTTP) or `unauthorized` (RPC). "Cold" is checked
by the scheduler's `prefill_tokens` counter, not by timing: the whole prompt is computed.
"""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest

from radixserve.client import Client, ServerError
from tests.server.conftest import ADMIN_KEY, KEY_A, KEY_B, KEY_D, stream_when_free
from tests.server.survival import assert_survived, baseline

PROMPT_LEN = 500
HIT = (PROMPT_LEN - 1) // 16 * 16  # all whole pages but the last token's


@pytest.fixture(scope="module")
def admin(tenant_admin):
    """The operator (conftest's tenant server): its stats count every tenant's prefills."""
    return tenant_admin


@pytest.fixture(scope="module")
def http(tenant_runtime):
    with httpx.Client(base_url=tenant_runtime.http_url, timeout=120) as c:
        yield c


_seeds = iter(range(1000, 100000))


def prompt() -> list[int]:
    """A fresh ~500-token prompt per call, so tests do not see each other's caches."""
    rng = random.Random(next(_seeds))
    return [rng.randrange(300, 20000) for _ in range(PROMPT_LEN)]


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


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
        assert cold(admin, lambda: generate(http, KEY_B, ids, **extra)) == (0, PROMPT_LEN)  # noqa: B023


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
            for call in (lambda: c.generate(input_ids=[5, 6],
                                            sampling_params={"max_new_tokens": 1}),
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
    """The operator's scrape has the per-tenant series (a tenant's has none: test_operator)."""
    generate(http, KEY_B, [11, 12, 13])
    text = http.get("/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).text
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


LONG = 1500
"""A's stream: long enough to outlive every attack (checked, not assumed)."""


def sse_events(lines) -> list[dict]:
    return [json.loads(line[6:]) for line in lines
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_rids_are_scoped_by_tenant_and_aborts_reach_only_their_callers(
        tenant_runtime, http, admin) -> None:
    """Issue 25, class 7: B reuses A's rid and hangs up, aborts it (HTTP, RPC, abort_all),
    abandons an RPC stream of that rid: A's stream ends intact; B's own requests of that
    rid run, and are aborted by B's hanging up and abandoning them."""
    before = baseline(admin)
    address = tenant_runtime.rpc_address
    long = {"max_new_tokens": LONG, "ignore_eos": True, "temperature": 0}
    shared = {"rid": "shared", "stream": True}
    decoded = admin.stats()["decode_tokens"]
    started = time.monotonic()
    with http.stream("POST", "/generate", headers=auth(KEY_A),
                     json={"input_ids": [7, 8, 9], "sampling_params": long, **shared}) as a:
        lines = a.iter_lines()
        assert "text" in sse_events([next(lines)])[0]  # A's request runs
        # B's request of the same rid is B's own (not "already in use"); B hangs up.
        with http.stream("POST", "/generate", headers=auth(KEY_B),
                         json={"input_ids": [9, 8, 7], "sampling_params": long,
                               **shared}) as b:
            assert b.status_code == 200 and "text" in sse_events([next(b.iter_lines())])[0]
        for body in ({"rid": "shared"}, {"abort_all": True}):
            assert http.post("/abort_request", headers=auth(KEY_B), json=body
                             ).status_code == 200
        with Client(address, timeout=120, api_key=KEY_B) as b_rpc:
            assert b_rpc.abort("shared") == {"aborted": "shared"}
            chunks = stream_when_free(b_rpc, "shared", input_ids=[9, 8, 7],
                                      sampling_params=long)
            chunks.close()  # abandoned: the client aborts it, as B
        attacked = time.monotonic() - started
        events = sse_events(lines)
    final = events[-1]["meta_info"]
    assert final["finish_reason"]["type"] == "length", final["finish_reason"]
    assert final["completion_tokens"] == LONG and final["id"] == "shared"
    assert final["e2e_latency"] > attacked, "A finished before the attacks: raise LONG"
    # B's two requests ended when B left them (else each would decode LONG tokens too).
    assert admin.stats()["decode_tokens"] - decoded < 2 * LONG
    # A tenant's abort reaches its own request of a rid another tenant also uses.
    with Client(address, timeout=120, api_key=KEY_A) as a_rpc, \
            Client(address, timeout=120, api_key=KEY_B) as b_rpc:
        theirs = a_rpc.generate(input_ids=[7, 8, 9], sampling_params=long, stream=True,
                                rid="both")
        mine = b_rpc.generate(input_ids=[9, 8, 7], sampling_params=long, stream=True,
                              rid="both")
        next(theirs), next(mine)
        b_rpc.abort("both")
        ended = [c for c in mine if "final" in c][0]["final"]["meta_info"]
        assert ended["finish_reason"]["type"] == "abort" and ended["id"] == "both"
        a_rpc.abort("both")
        assert [c for c in theirs if "final" in c][0]["final"]["meta_info"][
            "finish_reason"]["type"] == "abort"
    assert_survived(admin, before)
