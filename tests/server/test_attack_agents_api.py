"""Attacks on the agents' APIs (issue 55): another tenant's response id, previous_response_id
chains (deep, or to ids never stored), a huge input list, stored-response floods, malformed
items and blocks. Each is a clear 4xx naming the problem, nothing is stored past the bounds
(nor pinned past them), and the other tenant is unaffected; the server ends idle with every
KV block free."""

from __future__ import annotations

import time
from array import array

import httpx
import pytest

from radixserve.server.http.response_store import ResponseStore, Stored
from tests.server.conftest import (AGENT_KEY_A, AGENT_KEY_B, AGENT_STORED,
                                   assert_idle_and_all_free)

MODEL = "tiny"


@pytest.fixture(scope="module")
def a(agents_runtime):
    with httpx.Client(base_url=agents_runtime.http_url, timeout=300,
                      headers={"Authorization": f"Bearer {AGENT_KEY_A}"}) as c:
        yield c


@pytest.fixture(scope="module")
def b(agents_runtime):
    with httpx.Client(base_url=agents_runtime.http_url, timeout=300,
                      headers={"x-api-key": AGENT_KEY_B}) as c:
        yield c


def respond(client: httpx.Client, **body) -> httpx.Response:
    return client.post("/v1/responses", json={"model": MODEL, "max_output_tokens": 1,
                                              "temperature": 0, **body})


def refused(response: httpx.Response, status: int, param: str, words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_another_tenants_response_is_not_found(a, b, agents_admin):
    mine = respond(b, input="B's secret turn").json()["id"]
    for probe in (a.get(f"/v1/responses/{mine}"), a.delete(f"/v1/responses/{mine}"),
                  respond(a, input="continue", previous_response_id=mine)):
        assert probe.status_code == 404 and "no stored response" in probe.text, probe.text
    assert b.get(f"/v1/responses/{mine}").json()["id"] == mine  # untouched
    assert b.delete(f"/v1/responses/{mine}").status_code == 200
    assert agents_admin.stats()["pinned_tokens"] == 0


def test_a_flood_keeps_the_newest_and_a_deep_chain_costs_one_lookup(a, b, agents_admin):
    other = respond(b, input="B's turn").json()["id"]
    ids, previous = [], None
    for turn in range(3 * AGENT_STORED):  # a chain three times deeper than the store
        body = {"input": f"turn {turn}"}
        if previous is not None:
            body["previous_response_id"] = previous
        answer = respond(a, **body)
        assert answer.status_code == 200, answer.text
        previous = answer.json()["id"]
        ids.append(previous)
    kept = [i for i in ids if a.get(f"/v1/responses/{i}").status_code == 200]
    assert kept == ids[-AGENT_STORED:]  # the oldest went first
    # the last turn carried the whole conversation, though its ancestors are gone
    last = a.get(f"/v1/responses/{ids[-1]}").json()
    first = a.get(f"/v1/responses/{ids[-AGENT_STORED]}").json()
    assert last["usage"]["input_tokens"] > first["usage"]["input_tokens"]
    refused(respond(a, input="x", previous_response_id=ids[0]), 404,
            "previous_response_id", "no stored response")
    assert b.get(f"/v1/responses/{other}").status_code == 200  # B's store is its own
    for i in kept + [other]:
        (a if i != other else b).delete(f"/v1/responses/{i}")
    assert agents_admin.stats()["pinned_tokens"] == 0  # every pin went with its response


def test_the_store_drops_oldest_past_its_bytes_and_its_ttl():
    clock = [0.0]
    store = ResponseStore(max_count=100, max_bytes=4000, ttl=10, clock=lambda: clock[0])
    big = [{"role": "user", "content": "x" * 1500}]
    gone = [store.put("t", Stored(f"r{i}", {}, big)) for i in range(3)]
    assert [s.id for s in gone[2]] == ["r0"] and store.count("t")[1] <= 4000
    assert not store.fits(Stored("huge", {}, [{"content": "x" * 5000}]).size)
    clock[0] = 11
    found, expired = store.get("t", "r2")
    assert found is None and sorted(s.id for s in expired) == ["r1", "r2"]
    assert store.count("t") == (0, 0) and store.get("u", "r1")[0] is None


def test_a_prefix_two_responses_pinned_is_released_with_the_last():
    store = ResponseStore(max_count=100, max_bytes=10**6, ttl=10)
    for id in ("r0", "r1"):
        store.put("t", Stored(id, {}, [], array("i", [1, 2, 3])))
    store.put("t", Stored("r2", {}, [], array("i", [1, 2])))
    assert store.delete("t", "r0").pinned is None  # r1 holds the same pin
    assert list(store.delete("t", "r1").pinned) == [1, 2, 3]
    assert list(store.delete("t", "r2").pinned) == [1, 2] and not store.holders


def test_a_huge_input_list_is_refused_as_it_is_decoded(a):
    items = [{"role": "user", "content": "a"}] * 4097
    refused(respond(a, input=items), 400, "input", "length <= 4096")


@pytest.mark.parametrize("body,param,words", [
    ({"input": [{"type": "function_call", "call_id": "c"}]}, "input[0]",
     "needs call_id, name and arguments"),
    ({"input": [{"type": "mystery"}]}, "input[0].type", "'mystery' are not supported"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "got 'tool'"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]},
     "input[0].content[0]", "'input_audio' is not supported"),
    ({"input": [{"role": "user", "content": 7}]}, "input[0].content", "Expected"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice", "hosted tools"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "nope"}}]},
     "tools[0].parameters", "tools[0].parameters is not a valid JSON schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format",
     "text.format.schema is required"),
    ({"text": {"format": {"type": "json_object"}}, "tools": [
        {"type": "function", "name": "f"}]}, "text.format",
     "text.format cannot be enforced while tool_choice is auto"),
    ({"unknown": 1}, "unknown", "unknown field"),
    ({"max_output_tokens": 4000}, "max_output_tokens", "max_output_tokens=4000 exceeds"),
])
def test_malformed_items_are_named(a, body, param, words):
    refused(respond(a, input="hi", **body) if "input" not in body else respond(a, **body),
            400, param, words)


@pytest.mark.parametrize("body,words", [
    ({"messages": [{"role": "user", "content": [{"type": "text"}, {"type": "bogus"}]}]},
     "messages[0].content[1]: content of type 'bogus'"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f"}]}]},
     "needs id and name"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]}]},
     "messages[0].content[0].content[0]: content of type 'image'"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}] * 4097}, "length <= 4096"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"tools": [{"name": "f", "input_schema": {"type": "nope"}}]},
     "tools[0].input_schema is not a valid JSON schema"),
])
def test_malformed_blocks_are_named_in_anthropics_shape(b, body, words):
    answer = b.post("/v1/messages", json={"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": "hi"}], **body})
    assert answer.status_code == 400, answer.text
    error = answer.json()
    assert error["type"] == "error" and words in error["error"]["message"], error


@pytest.mark.parametrize("path,body", [
    ("/v1/responses", {"input": "Go on and on.", "max_output_tokens": 1500, "store": False}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Go on and on."}],
                      "max_tokens": 1500}),
])
def test_a_client_leaving_mid_stream_aborts_its_answer(a, agents_admin, path, body):
    aborted = agents_admin.stats()["aborted"]
    with a.stream("POST", path, json={"model": MODEL, "stream": True, "temperature": 0,
                                      **body}) as events:
        lines = events.iter_lines()
        assert next(lines).startswith("event: ")  # the stream began; now hang up
    deadline = time.monotonic() + 60
    while agents_admin.stats()["running"]:
        assert time.monotonic() < deadline, "the abandoned answer still runs"
        time.sleep(0.05)
    assert agents_admin.stats()["aborted"] == aborted + 1


def test_the_other_tenant_still_served_then_idle_and_all_free(b, agents_admin):
    assert respond(b, input="still here", store=False).status_code == 200
    assert b.post("/v1/messages", json={"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": "still here"}]}).status_code == 200
    counted = b.get("/metrics").text
    for endpoint in ("responses", "messages"):
        assert f'radixserve_requests_total{{endpoint="{endpoint}"' in counted
    assert agents_admin.stats()["pinned_tokens"] == 0
    assert_idle_and_all_free(agents_admin)
