"""The operator's role and what tenants cannot learn without timing (issue 25, classes 5
and 6), on the package's tenant server (conftest: tenant-a, tenant-b, a bare key of the
default tenant, and an operator key). Each attack goes over the real surface (RPC, HTTP,
the cache-events socket) and ends with the survival check."""

from __future__ import annotations

import random
import time

import httpx
import msgspec
import pytest
import zmq

from radixserve.client import Client, ServerError
from radixserve.messages import CacheEvents
from radixserve.tenants import load_cache_secret, namespace_of
from radixserve.transport.cache_events import subscribe
from tests.server.conftest import ADMIN_KEY, KEY_A, KEY_B, KEY_D, TENANT_PIN_QUOTA
from tests.server.survival import assert_survived, baseline

TENANT_KEYS = (KEY_A, KEY_B, KEY_D)
"""A bare key is the default tenant's, not the operator's, once there are several."""
OPERATOR_ROUTES = (("POST", "/flush_cache"), ("POST", "/start_profile"),
                   ("POST", "/stop_profile"), ("POST", "/add_worker?url=tcp://127.0.0.1:9"),
                   ("POST", "/remove_worker?url=tcp://127.0.0.1:9"), ("GET", "/list_workers"))


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def tenant_a(tenant_runtime):
    with Client(tenant_runtime.rpc_address, timeout=120, api_key=KEY_A) as c:
        yield c


@pytest.fixture(scope="module")
def http(tenant_runtime):
    with httpx.Client(base_url=tenant_runtime.http_url, timeout=120) as c:
        yield c


def forbidden(call) -> ServerError:
    with pytest.raises(ServerError) as refused:
        call()
    assert refused.value.code == "forbidden", refused.value
    assert "--admin-api-key" in refused.value.message
    return refused.value


def test_operator_calls_need_the_operator_key_over_rpc(tenant_runtime, tenant_a, tenant_admin):
    before = baseline(tenant_a)
    for key in TENANT_KEYS:
        with Client(tenant_runtime.rpc_address, timeout=30, api_key=key) as c:
            for call in (c.flush_cache, c.cache_snapshot, c.start_profile, c.stop_profile,
                         c.workers, lambda: c.start_profile("x")):
                forbidden(call)
            assert "pinned_tokens" not in c.stats()  # every tenant's pins: the operator's
    with Client(tenant_runtime.rpc_address, timeout=30) as anonymous:
        with pytest.raises(ServerError, match="api_key") as refused:
            anonymous.flush_cache()
        assert refused.value.code == "unauthorized"
    assert tenant_admin.cache_snapshot()["hashes"] is not None
    assert "pinned_tokens" in tenant_admin.stats()
    assert_survived(tenant_a, before, operator=tenant_admin)


def test_operator_calls_need_the_operator_key_over_http(http, tenant_a, tenant_admin):
    before = baseline(tenant_a)
    for key in TENANT_KEYS:
        for method, path in OPERATOR_ROUTES:
            r = http.request(method, path, headers=bearer(key))
            assert r.status_code == 403, (key, path, r.text)
            assert r.json()["error"]["code"] == "forbidden"
            assert "--admin-api-key" in r.json()["error"]["message"]
    for method, path in OPERATOR_ROUTES:
        assert http.request(method, path).status_code == 401
    assert http.post("/flush_cache", headers=bearer(ADMIN_KEY)).status_code == 200
    assert_survived(tenant_a, before, operator=tenant_admin)


def test_server_info_a_tenant_sees(http, tenant_a, tenant_admin):
    """The operator sees the configuration (but the keys); a tenant the limits its own
    requests meet, and nothing of other tenants, keys or paths."""
    before = baseline(tenant_a)
    full = http.get("/get_server_info", headers=bearer(ADMIN_KEY)).json()
    assert full["profile_dir"] and full["rpc_host"] and full["max_pinned_tokens_per_tenant"]
    for secret in ("api_key", "api_keys_file", "admin_api_key"):
        assert secret not in full
    reduced = http.get("/get_server_info", headers=bearer(KEY_A)).json()
    assert reduced["max_prompt_chars"] == full["max_prompt_chars"]
    for hidden in ("profile_dir", "rpc_port", "host", "api_keys_file", "kv_disk_dir",
                   "cache_secret_file", "max_pinned_tokens_per_tenant", "max_total_tokens"):
        assert hidden not in reduced, hidden
    text = str(reduced)
    for leak in ("tenant-b", KEY_B, KEY_D, ADMIN_KEY, "pinned_tokens"):
        assert leak not in text, leak
    assert_survived(tenant_a, before, operator=tenant_admin)


def test_metrics_show_no_tenant_names_to_a_tenant(http, tenant_a, tenant_admin):
    before = baseline(tenant_a)
    r = http.post("/generate", headers=bearer(KEY_B), json={
        "input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200, r.text
    for key in TENANT_KEYS:
        text = http.get("/metrics", headers=bearer(key)).text
        assert "radixserve_requests_total" in text  # the server's own series are there
        for leak in ("tenant=", "tenant-b", "tenant-a", "radixserve_kv_pinned_tokens"):
            assert leak not in text, (key, leak)
    text = http.get("/metrics", headers=bearer(ADMIN_KEY)).text
    assert 'radixserve_tenant_requests_total{tenant="tenant-b"}' in text
    assert "radixserve_kv_pinned_tokens" in text
    assert_survived(tenant_a, before, operator=tenant_admin)


def receives(address: str, key: str | None, seconds: float) -> int:
    """How many CacheEvents a subscriber with `key` gets in `seconds` (the replica sends
    a heartbeat every second)."""
    ctx = zmq.Context()
    try:
        sub = subscribe(ctx, address, key)
        decoder = msgspec.msgpack.Decoder(CacheEvents)
        got, deadline = 0, time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if sub.poll(int(left * 1000) + 1):
                decoder.decode(sub.recv())
                got += 1
        return got
    finally:
        ctx.destroy(linger=0)


def test_cache_events_are_the_operators(tenant_a, tenant_admin):
    """Issue 25, class 5: the events socket carries every tenant's page hashes; a
    subscriber without the operator key receives nothing."""
    before = baseline(tenant_a)
    address = tenant_a.model_info()["cache_events_address"]
    for key in (None, KEY_A, KEY_D, "made-up"):
        assert receives(address, key, 3.0) == 0, key
    assert receives(address, ADMIN_KEY, 3.0) >= 1
    assert_survived(tenant_a, before, operator=tenant_admin)


def test_a_tenants_namespace_needs_the_deployment_secret(tenant_a, tenant_admin):
    """Issue 25, class 5: the namespace a tenant's requests are cached in is not what
    anyone can compute from its name (unkeyed), nor another deployment's."""
    before = baseline(tenant_a)
    ids = [random.Random(7).randrange(300, 20000) for _ in range(64)]
    tenant_a.generate(input_ids=ids, sampling_params={"max_new_tokens": 1},
                      cache_salt="secret-check")
    seen = {n["namespace"] for n in tenant_a.cache_info(top=1000)["nodes"]}
    elsewhere = {namespace_of("tenant-a", "secret-check", secret)
                 for secret in (b"", load_cache_secret(None))}
    assert seen and all(ns.startswith("ns-") for ns in seen)
    assert not seen & elsewhere
    assert_survived(tenant_a, before, operator=tenant_admin)


def prefix(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 20000) for _ in range(length)]


def test_pins_have_a_quota_a_longest_ttl_and_a_private_total(tenant_runtime, tenant_a,
                                                             tenant_admin):
    """Issue 25, class 6: a tenant cannot pin more than its share, or for longer than
    --max-pin-ttl, and its answers give its own pinned total, not the pool's."""
    before = baseline(tenant_a)
    with Client(tenant_runtime.rpc_address, timeout=120, api_key=KEY_B) as tenant_b:
        try:
            b = tenant_b.pin_prefix(input_ids=prefix(1, 100))
            assert b["pinned_tokens"] == 96 and 0 < b["expires_in"] <= 600
            a = tenant_a.pin_prefix(input_ids=prefix(2, 200), ttl=30)
            assert a["pinned_tokens"] == 192, "its own total, not the pool's"
            with pytest.raises(ServerError, match="max-pinned-tokens-per-tenant"):
                tenant_a.pin_prefix(input_ids=prefix(3, 100))  # 192 + 96 > quota
            assert 192 + 96 > TENANT_PIN_QUOTA
            with pytest.raises(ServerError, match="max-pin-ttl"):
                tenant_a.pin_prefix(input_ids=prefix(4, 32), ttl=601)
            # The operator's pins are bounded by --max-pinned-tokens alone.
            op = tenant_admin.pin_prefix(input_ids=prefix(5, 300))
            assert op["expires_in"] is None and op["pinned_tokens"] == 96 + 192 + 288
            assert tenant_a.unpin_all()["pinned_tokens"] == 0
            assert tenant_b.unpin_all()["pinned_tokens"] == 0
        finally:
            tenant_admin.unpin_all()
            tenant_a.unpin_all()
            tenant_b.unpin_all()
    assert_survived(tenant_a, before, operator=tenant_admin)


def test_profiles_stay_in_the_profile_directory(http, tenant_a, tenant_admin):
    """Issue 25, class 6: a trace goes to the server's --profile-dir, or one name inside
    it; a path, `..` or an absolute folder is refused before anything is made."""
    before = baseline(tenant_a)
    base = http.get("/get_server_info", headers=bearer(ADMIN_KEY)).json()["profile_dir"]
    for bad in ("../escape", "/tmp/radixserve-escape", "a/b", ".hidden", "..", "x" * 100):
        with pytest.raises(ServerError, match="--profile-dir") as refused:
            tenant_admin.start_profile(bad)
        assert refused.value.code == "invalid_request"
        r = http.post("/start_profile", headers=bearer(ADMIN_KEY), json={"output_dir": bad})
        assert r.status_code == 400, r.text
    started = tenant_admin.start_profile("run-1")
    assert started["output_dir"] == f"{base}/run-1"
    tenant_a.generate("Hello", {"max_new_tokens": 2})
    stopped = tenant_admin.stop_profile()
    assert stopped["trace"].startswith(f"{base}/run-1/")
    assert_survived(tenant_a, before, operator=tenant_admin)
