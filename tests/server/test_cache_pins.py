"""Pins and the cache view over HTTP and RPC, on a server of its own (two tenants' API
keys, a small pool, a tiny random-weight model with the real tokenizer): a pin survives a
flood and is a hit on re-use, unpin, the bound as a 400 naming the flag, a tenant's pins
and prefixes are its own; /cache and the /cache/view page show the prompts that were
sent (the page parsed with html.parser); hits by tier in /metrics; all blocks free at the
end."""

from __future__ import annotations

from html.parser import HTMLParser

import httpx
import pytest

from radixserve.client import Client, ServerError
from radixserve.server.runtime import Runtime
from tests.factories import tiny_model_dir
from tests.server.conftest import assert_idle_and_all_free, assert_server_idle

KEY_A, KEY_B, ADMIN = "sk-pin-a", "sk-pin-b", "sk-pin-admin"
GREEDY = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
SYSTEM_A = ("Tenant alpha's system prompt: you index the old maritime charts of the "
            "harbour archive and reply with the chart number only. ") * 3
TOO_MANY = "A second long prefix of tenant alpha, past the bound with the first. " * 8
SYSTEM_B = "Tenant beta's system prompt: you translate recipes into metric units. " * 4


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    tiny = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")
    with Runtime(str(tiny), max_total_tokens=512, page_size=16, debug_invariants=True,
                 max_pinned_tokens=128, max_pinned_tokens_per_tenant=128,
                 api_key=[f"{KEY_A}=tenant-a", f"{KEY_B}=tenant-b"], admin_api_key=ADMIN) as rt:
        yield rt
        assert_server_idle(rt.rpc_address, api_key=ADMIN)


@pytest.fixture(scope="module")
def http(runtime):
    with httpx.Client(base_url=runtime.http_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def rpc_a(runtime):
    with Client(runtime.rpc_address, timeout=120, api_key=KEY_A) as c:
        yield c


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def generate(http: httpx.Client, key: str, text: str) -> dict:
    r = http.post("/generate", headers=auth(key), json={"text": text, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]


class PageText(HTMLParser):
    """Every text run of a page, and whether it loads anything from elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: list[str] = []
        self.external: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "script" or any(k in ("src", "href") for k, _ in attrs):
            self.external.append(tag)

    def handle_data(self, data: str) -> None:
        if data.strip():
            self.texts.append(data)


class TestPinOverHttp:
    def test_pin_survives_a_flood_then_unpin(self, http, rpc_a) -> None:
        r = http.post("/cache/pin", headers=auth(KEY_A), json={"text": SYSTEM_A, "ttl": 600})
        assert r.status_code == 200, r.text
        pinned = r.json()["tokens"]
        assert pinned >= 64 and 599 < r.json()["expires_in"] <= 600
        for i in range(6):  # ~150 tokens each into a pool of 512
            generate(http, KEY_A, f"Flood {i}: " + " ".join(f"w{i}z{j}" for j in range(70)))
        meta = generate(http, KEY_A, SYSTEM_A + " Chart for Dover?")
        assert meta["cached_tokens"] >= pinned
        assert meta["cached_tokens_details"] == {"memory": meta["cached_tokens"], "disk": 0}
        metrics = http.get("/metrics", headers=auth(KEY_A)).text
        assert 'radixserve_cache_hit_tokens_total{tier="memory"}' in metrics
        assert "radixserve_cached_prompt_tokens_total" in metrics  # the old name stays
        assert "radixserve_kv_pinned_tokens" not in metrics  # every tenant's: the operator's
        metrics = http.get("/metrics", headers=auth(ADMIN)).text
        assert f"radixserve_kv_pinned_tokens {float(pinned)}" in metrics
        # Another tenant cannot unpin it, nor does it get its tokens from the cache.
        r = http.post("/cache/unpin", headers=auth(KEY_B), json={"text": SYSTEM_A})
        assert r.status_code == 200 and not r.json()["unpinned"]
        assert generate(http, KEY_B, SYSTEM_A + " Chart for Dover?")["cached_tokens"] == 0
        assert rpc_a.unpin_prefix(SYSTEM_A)["unpinned"]

    def test_bound_and_bad_bodies_are_400s(self, http, rpc_a) -> None:
        rpc_a.pin_prefix(SYSTEM_A)
        r = http.post("/cache/pin", headers=auth(KEY_A),
                      json={"text": TOO_MANY})
        assert r.status_code == 400 and "--max-pinned-tokens" in r.text, r.text
        with pytest.raises(ServerError, match="--max-pinned-tokens"):
            rpc_a.pin_prefix(TOO_MANY)
        assert http.post("/cache/pin", headers=auth(KEY_A), json={}).status_code == 400
        assert http.post("/cache/pin", headers=auth(KEY_A),
                         json={"text": "x", "ttl": -1}).status_code == 400
        assert http.post("/cache/pin", json={"text": SYSTEM_A}).status_code == 401
        assert rpc_a.unpin_prefix(SYSTEM_A)["unpinned"]


class TestCacheView:
    def test_json_and_page_show_only_the_callers_prefixes(self, http, rpc_a, runtime) -> None:
        with Client(runtime.rpc_address, timeout=120, api_key=ADMIN) as admin:
            assert admin.flush_cache() == {"flushed": True}  # B cached A's prompt above
        generate(http, KEY_A, SYSTEM_A + " Chart for Calais?")
        generate(http, KEY_B, SYSTEM_B + " Pancakes?")
        http.post("/cache/pin", headers=auth(KEY_B), json={"text": SYSTEM_B})
        info = http.get("/cache", headers=auth(KEY_A), params={"top": 10}).json()
        texts = [n["text"] for n in info["nodes"]]
        assert any(t.startswith("Tenant alpha's system prompt") for t in texts), texts
        assert not any("beta" in t for t in texts) and info["pins"] == []
        assert set(info["totals"]) == {"memory", "disk"}
        assert all(n["tier"] == "memory" for n in info["nodes"])
        b = http.get("/cache", headers=auth(KEY_B)).json()
        assert b["pins"][0]["text"].startswith("Tenant beta's")
        assert not any("alpha" in n["text"] for n in b["nodes"])
        via_rpc = rpc_a.cache_info(top=10)
        assert [n["text"] for n in via_rpc["nodes"]] == texts  # the same call over RPC

        r = http.get("/cache/view", headers=auth(KEY_A))
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        page = PageText()
        page.feed(r.text)
        assert any("Tenant alpha" in t for t in page.texts), page.texts
        assert not any("beta" in t for t in page.texts) and page.external == []
        assert http.get("/cache", headers=auth(KEY_A), params={"top": -1}).status_code == 400
        assert http.post("/cache/unpin", headers=auth(KEY_B),
                         json={"text": SYSTEM_B}).json()["unpinned"]


def test_unpin_all_reaches_the_callers_tenant_only(http, rpc_a, runtime) -> None:
    a_tokens = rpc_a.pin_prefix(SYSTEM_A)["tokens"]
    with Client(runtime.rpc_address, timeout=120, api_key=KEY_B) as b:
        b.pin_prefix(SYSTEM_B, cache_salt="s")
        dropped = b.unpin_all()  # B's own (salted) pin, not A's; B's own total after
        assert dropped["pins"] == 1 and dropped["pinned_tokens"] == 0, dropped
    assert rpc_a.cache_info()["pins"][0]["tokens"] == a_tokens
    r = http.post("/cache/unpin", headers=auth(KEY_A), json={"all": True, "text": "x"})
    assert r.status_code == 400
    r = http.post("/cache/unpin", headers=auth(KEY_A), json={"all": True})
    assert r.status_code == 200 and r.json()["pins"] == 1 and r.json()["pinned_tokens"] == 0


def test_all_blocks_free_at_the_end(runtime) -> None:
    with Client(runtime.rpc_address, timeout=120, api_key=KEY_A) as c:
        assert c.cache_info()["pins"] == []
    with Client(runtime.rpc_address, timeout=120, api_key=ADMIN) as admin:
        assert_idle_and_all_free(admin)
