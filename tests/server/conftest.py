"""Servers started once for the package: one with the default model for the HTTP tests
(test_http, test_openai), with an API key so that every HTTP test also exercises auth; and
one with several tenants and an operator key (test_tenants, test_operator), on a tiny
random-weight model with the real tokenizer."""

from __future__ import annotations

import time
from typing import Any, Iterator

import httpx
import pytest

from radixserve.client import Client, ServerError
from radixserve.server.runtime import Runtime
from tests.factories import tiny_model_dir

API_KEY = "sk-radixserve-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
KEY_A, KEY_B, KEY_D = "sk-tenant-a", "sk-tenant-b==", "sk-default"
"""The tenant server's keys: tenant-a's, tenant-b's (from a keys file), a bare key."""
ADMIN_KEY = "sk-operator"
TENANT_POOL = 4096
TENANT_PIN_QUOTA = 256
"""--max-pinned-tokens-per-tenant on the tenant server."""


@pytest.fixture(scope="package")
def http_runtime(model_dir):
    with Runtime(str(model_dir), max_total_tokens=16384, debug_invariants=True,
                 api_key=API_KEY, served_model_name="smollm2-135m") as rt:
        yield rt
        assert_server_idle(rt.rpc_address, api_key=API_KEY)


@pytest.fixture(scope="package")
def tenant_runtime(tmp_path_factory):
    tiny = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")
    keys_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys_file.write_text(f"# key tenant\n{KEY_B} tenant-b\n\n")
    with Runtime(str(tiny), max_total_tokens=TENANT_POOL, debug_invariants=True,
                 api_key=[f"{KEY_A}=tenant-a", KEY_D], api_keys_file=str(keys_file),
                 admin_api_key=ADMIN_KEY, schedule_policy="lpm",
                 profile_dir=str(tmp_path_factory.mktemp("profiles")),
                 max_pinned_tokens_per_tenant=TENANT_PIN_QUOTA, max_pin_ttl=600) as rt:
        yield rt
        assert_server_idle(rt.rpc_address, api_key=ADMIN_KEY)


@pytest.fixture(scope="package")
def tenant_admin(tenant_runtime):
    """The tenant server's operator."""
    with Client(tenant_runtime.rpc_address, timeout=120, api_key=ADMIN_KEY) as c:
        yield c


@pytest.fixture(scope="package")
def rpc(http_runtime):
    """The RPC client of the same server: the reference the HTTP answers must equal."""
    with Client(http_runtime.rpc_address, timeout=300, api_key=API_KEY) as c:
        yield c


@pytest.fixture(scope="package")
def http(http_runtime):
    with httpx.Client(base_url=http_runtime.http_url, headers=AUTH, timeout=300) as c:
        yield c


def assert_idle_and_all_free(client: Client) -> None:
    """Nothing running or queued, and after a flush every KV block is free again.
    `client`: one that may flush (the operator's, where the server has an operator key)."""
    assert client.flush_cache() == {"flushed": True}
    s = client.stats()
    assert s["running"] == 0 and s["waiting"] == 0, s
    assert s["free_blocks"] == s["num_blocks"], f"blocks lost: {s}"


DRAINED_WITHIN = 60
"""Seconds a server has, after its module's last test, to end what the tests left behind
(a closed stream's abort lands within a step or two; a finished one may still be
sending): a request that never ends fails the check."""


def assert_server_idle(address: str, **client_options: Any) -> None:
    """What every server fixture checks at its teardown, after its module's tests: nothing
    left running once the last aborts have landed, then `assert_idle_and_all_free`,
    through a client of its own to the RPC `address` built with `client_options` (the key
    that may flush)."""
    with Client(address, timeout=120, **client_options) as client:
        deadline = time.monotonic() + DRAINED_WITHIN
        while (s := client.stats())["running"] or s["waiting"]:
            assert time.monotonic() < deadline, f"still busy {DRAINED_WITHIN} s on: {s}"
            time.sleep(0.05)
        assert_idle_and_all_free(client)


def stream_when_free(client: Client, rid: str, **call: Any) -> Iterator[dict]:
    """A stream of `rid` with its first chunk read, once the caller's previous request of
    that rid has ended: an abort (or a hang-up) lands a step later, and until then the rid
    is still the caller's, in use. Retried for up to DRAINED_WITHIN seconds."""
    deadline = time.monotonic() + DRAINED_WITHIN
    while True:
        chunks = client.generate(rid=rid, stream=True, **call)
        try:
            next(chunks)
            return chunks
        except ServerError as e:
            if "already in use" not in e.message or time.monotonic() > deadline:
                raise
        time.sleep(0.1)



AGENT_KEY_A, AGENT_KEY_B = "sk-agents-a", "sk-agents-b"
"""The agents server's two tenants' keys (agents-a, agents-b)."""
AGENT_ADMIN = "sk-agents-operator"
AGENT_STORED = 6
"""--max-stored-responses on the agents server."""
AGENT_STORED_BYTES = 256 << 10
"""--max-stored-response-bytes on the agents server."""


@pytest.fixture(scope="package")
def agents_runtime(tmp_path_factory):
    """The server of the agents' APIs (Responses, Messages): a tiny random-weight model with
    the real tokenizer, two tenants and an operator, small stored-response bounds."""
    tiny = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")
    with Runtime(str(tiny), max_total_tokens=16384, debug_invariants=True,
                 api_key=[f"{AGENT_KEY_A}=agents-a", f"{AGENT_KEY_B}=agents-b"],
                 admin_api_key=AGENT_ADMIN, served_model_name="tiny",
                 max_stored_responses=AGENT_STORED,
                 max_stored_response_bytes=AGENT_STORED_BYTES) as rt:
        yield rt
        assert_server_idle(rt.rpc_address, api_key=AGENT_ADMIN)


@pytest.fixture(scope="package")
def agents_admin(agents_runtime):
    with Client(agents_runtime.rpc_address, timeout=120, api_key=AGENT_ADMIN) as c:
        yield c
