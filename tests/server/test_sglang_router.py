"""SGLang's own router (`sglang-router`, pinned in the test extra) in front of radixserve,
unchanged: the fields it adds to every request are accepted (checked against what the
installed router really sends), and in front of two `radixserve serve` replicas the native
and OpenAI routes answer through it, streamed or not; a client hanging up aborts the
request on its replica; `cache_aware` sends a shared prefix back to the replica that cached
it; a stopped replica is taken out by the router's health checks while requests keep being
answered."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import msgspec
import pytest

from radixserve.client import Client
from radixserve.server.http import native
from radixserve.server.http import openai_protocol as proto
from radixserve.server.http.foreign_fields import default_only
from radixserve.server.runtime import Runtime
from tests.factories import tiny_model_dir
from tests.server.conftest import DRAINED_WITHIN, assert_server_idle
from tests.server.sglang_router import Recorder, Router, smg

pytestmark = pytest.mark.skipif(smg() is None, reason="sglang-router (the test extra) missing")

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
SENT = {"/generate": {"text": "hello", "sampling_params": {"max_new_tokens": 4}},
        "/v1/chat/completions": CHAT,
        "/v1/completions": {"prompt": "hello", "max_tokens": 4}}
"""The smallest request of each route a client sends the router."""

ROUTER_ADDS = {
    "/generate": {"model", "return_text_in_logprobs", "stream", "log_metrics",
                  "return_hidden_states", "background", "no_logs", "return_bytes",
                  "return_entropy"},
    "/v1/chat/completions": {"logprobs", "max_completion_tokens", "stream", "no_stop_trim",
                             "ignore_eos", "continue_final_message", "skip_special_tokens",
                             "separate_reasoning", "stream_reasoning",
                             "return_hidden_states"},
    "/v1/completions": {"stream", "echo", "no_stop_trim", "ignore_eos",
                        "skip_special_tokens", "return_hidden_states"},
}
"""What sglang-router 0.3.2 adds to each route's request, at its defaults (chat's
`max_tokens` it renames `max_completion_tokens`), as recorded from the router itself."""

BODIES = {"/generate": native.GenerateBody, "/v1/chat/completions": proto.ChatRequest,
          "/v1/completions": proto.CompletionRequest}


def test_every_field_the_router_sends_is_accepted(tmp_path):
    """The installed router's requests, recorded behind it, decode as radixserve's bodies
    and pass the default-only rule; and the fields it adds are those listed above (a new
    router version's new field fails here, naming it)."""
    recorder = Recorder()
    router = Router([recorder.url], tmp_path / "router.log", policy="round_robin")
    try:
        for path, body in SENT.items():
            for stream in (False, True):
                extra = {"model": "tiny"} if path.startswith("/v1") else {}
                httpx.post(router.url + path, json={**body, **extra, "stream": stream},
                           timeout=30)
    finally:
        router.stop()
        recorder.close()
    for path, kind in BODIES.items():
        bodies = list(recorder.bodies(path))
        assert len(bodies) == 2, (path, recorder.requests)
        for body in bodies:
            decoded = msgspec.convert(body, kind)  # an unknown field fails, named
            assert all(getattr(decoded, name) == default  # a foreign field at its default
                       for name, (default, _) in default_only(kind).items()), body
            sent = set(SENT[path]) | ({"model"} if path.startswith("/v1") else set())
            added = set(body) - sent
            assert added == ROUTER_ADDS[path], (path, added ^ ROUTER_ADDS[path])


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[tuple[Router, list[Runtime]]]:
    """Two replicas of a tiny model behind the router (`cache_aware`); at the end, the
    replicas still running are idle with every KV block free."""
    tiny = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")
    replicas: list[Runtime] = []
    try:
        for _ in range(2):
            replicas.append(Runtime(str(tiny), max_total_tokens=4096,
                                    served_model_name="tiny", debug_invariants=True))
        router = Router([r.http_url for r in replicas],
                        tmp_path_factory.mktemp("router") / "router.log")
        try:
            yield router, replicas
        finally:
            router.stop()
        for r in replicas:
            if r.process.is_alive():
                assert_server_idle(r.rpc_address)
    finally:
        for r in replicas:
            r.shutdown()


def post(router: Router, path: str, body: dict[str, Any]) -> dict[str, Any]:
    answer = httpx.post(router.url + path, json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


def events(router: Router, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed answer's events, [DONE] excluded."""
    with httpx.stream("POST", router.url + path, json={**body, "stream": True},
                      timeout=120) as answer:
        assert answer.status_code == 200, answer.read()
        data = [line[6:] for line in answer.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]", data
    return [json.loads(d) for d in data[:-1]]


def test_routes_answer_through_the_router(fleet):
    """What the router read from each replica's /server_info and /model_info names the
    model; then each route answers through it, streamed and not."""
    router, replicas = fleet
    workers = router.workers()
    assert {(w["model_id"], w["metadata"]["model_path"]) for w in workers} == {
        ("tiny", str(Path(replicas[0].config.model)))}, workers
    out = post(router, "/generate", {"text": "The capital of France",
                                     "sampling_params": {"max_new_tokens": 4,
                                                         "temperature": 0}})
    assert out["meta_info"]["completion_tokens"] == 4
    streamed = events(router, "/generate", {"text": "The capital of France",
                                            "sampling_params": {"max_new_tokens": 4,
                                                                "temperature": 0}})
    assert streamed[-1]["text"] == out["text"]
    chat = post(router, "/v1/chat/completions", {"model": "tiny", **CHAT})
    assert chat["usage"]["completion_tokens"] == 4
    chunks = events(router, "/v1/chat/completions", {"model": "tiny", **CHAT})
    assert chunks[0]["object"] == "chat.completion.chunk"
    cmpl = post(router, "/v1/completions", {"model": "tiny", "prompt": "hello",
                                            "max_tokens": 4})
    assert cmpl["choices"][0]["finish_reason"] == "length"
    assert events(router, "/v1/completions", {"model": "tiny", "prompt": "hello",
                                              "max_tokens": 4})
    assert httpx.get(router.url + "/v1/models", timeout=10).json()["data"][0]["id"] == "tiny"


@pytest.mark.parametrize("path", list(SENT))
def test_the_rule_for_foreign_fields(fleet, path):
    """A field radixserve knows but cannot honour is refused by name at another value
    than its default, through the router too; an unknown field (a typo) is refused by
    name (the router itself drops the fields it does not know: asked directly)."""
    router, replicas = fleet
    body = {**SENT[path], **({"model": "tiny"} if path.startswith("/v1") else {})}
    for url, extra, named in ((router.url, {"return_hidden_states": True},
                               "return_hidden_states"),
                              (replicas[0].http_url, {"temprature": 0.5}, "temprature")):
        answer = httpx.post(url + path, json={**body, **extra}, timeout=60)
        assert answer.status_code == 400 and named in answer.text, answer.text


def test_hanging_up_aborts_on_the_replica(fleet):
    """The router passes a client's hang-up on: the replica aborts the request (it would
    run 2000 tokens otherwise)."""
    router, replicas = fleet

    def aborted() -> tuple[int, int]:
        """Requests running and requests aborted, over the replicas."""
        stats = []
        for r in replicas:
            with Client(r.rpc_address, timeout=30) as c:
                stats.append(c.stats())
        return sum(s["running"] for s in stats), sum(s["aborted"] for s in stats)

    before = aborted()[1]
    body = {"text": "count", "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    with httpx.stream("POST", router.url + "/generate", json=body, timeout=120) as answer:
        assert next(answer.iter_lines()).startswith("data: ")
    deadline = time.monotonic() + DRAINED_WITHIN
    while (now := aborted()) != (0, before + 1):
        assert time.monotonic() < deadline, f"running, aborted: {now}; before: {before}"
        time.sleep(0.1)


PREFIXES = [f"Document {k}: " + " ".join(f"{w}{k}" for w in ("alpha", "beta", "gamma",
                                                              "delta", "epsilon") * 12)
            for k in range(4)]


def test_cache_aware_sends_a_prefix_back_to_its_replica(fleet):
    """A second round on the same prefixes (new questions) finds each prefix cached: the
    router sent each to the replica that served it first."""
    router, _ = fleet
    for round_, prefixes in (("first", PREFIXES), ("second", PREFIXES[::-1])):
        # reversed: round robin would send each prefix to the other replica this time
        cached = [post(router, "/generate", {
            "text": f"{prefix} Question: {round_}?",
            "sampling_params": {"max_new_tokens": 1}})["meta_info"]["cached_tokens"]
            for prefix in prefixes]
    assert all(c >= 32 for c in cached), cached


def test_power_of_two_reads_each_replica_s_load(fleet, tmp_path):
    """`power_of_two` compares SGLang's load report (`/get_load`) of two replicas: a
    request running on a replica shows there, and the policy routes. (The router polls
    loads every 30 s, not configurable, so that it reads them is not waited for here.)"""
    _, replicas = fleet
    url = replicas[0].http_url
    body = {"text": "busy", "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}
    busy = threading.Thread(target=httpx.post, args=(url + "/generate",),
                            kwargs={"json": body, "timeout": 120})
    busy.start()
    deadline = time.monotonic() + 60
    # Until the request runs: queued, it is counted but holds no KV yet.
    while (load := httpx.get(url + "/get_load", timeout=30).json())[0]["num_tokens"] == 0:
        assert time.monotonic() < deadline, load
    busy.join()
    assert load[0]["dp_rank"] == 0 and load[0]["num_reqs"] == 1 and load[0]["num_tokens"] > 0
    router = Router([r.http_url for r in replicas], tmp_path / "router.log",
                    policy="power_of_two")
    try:
        for k in range(4):
            post(router, "/generate", {"text": f"two choices {k}",
                                       "sampling_params": {"max_new_tokens": 2}})
    finally:
        router.stop()


def test_a_stopped_replica_is_taken_out(fleet):
    """Last in the module: it stops a replica."""
    router, replicas = fleet
    replicas[1].shutdown()
    router.wait_healthy(1)
    for k in range(6):
        post(router, "/generate", {"text": f"still here {k}",
                                   "sampling_params": {"max_new_tokens": 2}})
