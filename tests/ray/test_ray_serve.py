"""radixserve on Ray Serve (radixserve/ray): two replicas on two nodes of a local cluster,
behind Ray's HTTP proxy, answering as one plain server does and routed by their trees;
then, autoscaled, scaled up under a burst and back down, draining the replica it stops."""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
import time

import httpx
import pytest
from concurrent.futures import ThreadPoolExecutor

pytest.importorskip("ray.serve", reason="ray[serve] is an optional extra (radixserve[ray])")

from radixserve.client import Client
from radixserve.ray.keys import REPLICA_HEADER
from radixserve.router.view import LINGER
from tests.ray.cluster import (APP, app_args, replica_actors, replica_states, replicas,
                               wait_for)
from tests.server.conftest import assert_server_idle

GREEDY = {"temperature": 0, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def reference(plain):
    with httpx.Client(base_url=plain, timeout=120) as c:
        yield c


def test_two_replicas_on_two_nodes_answer_as_one_server(served, http, reference):
    found = replicas(served)
    assert len(found) == 2 and len({r["node"] for r in found.values()}) == 2, found

    for text in ["The quick brown fox", "Once upon a time, in a land far away,", "1 2 3 4"]:
        body = {"text": text, "sampling_params": GREEDY}
        got, want = http.post("/generate", json=body), reference.post("/generate", json=body)
        assert got.status_code == 200, got.text
        assert got.json()["output_ids"] == want.json()["output_ids"]
        assert got.headers[REPLICA_HEADER] in found

    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Say something."}],
            "temperature": 0, "max_tokens": 8}
    got, want = http.post("/v1/chat/completions", json=chat), \
        reference.post("/v1/chat/completions", json=chat)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["message"] == want.json()["choices"][0]["message"]

    completion = {"model": "tiny", "prompt": "Streams arrive", "temperature": 0,
                  "max_tokens": 8}
    whole = http.post("/v1/completions", json=completion).json()["choices"][0]["text"]
    with http.stream("POST", "/v1/completions", json={**completion, "stream": True}) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith(
            "text/event-stream")
        events = [line[len("data: "):] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 2
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == whole

    models = http.get("/v1/models")
    assert [m["id"] for m in models.json()["data"]] == ["tiny"]
    bad = http.post("/v1/chat/completions", json={**chat, "model": "nope"})
    assert bad.status_code == 404 and "nope" in bad.text  # the replica's own error


def test_second_round_lands_on_the_replicas_holding_its_prefixes(served, http):
    """Four groups, each with its own long prefix: the first round spreads them over both
    replicas; the second (after the routed prefixes stopped counting provisionally, so
    only the replicas' cache events tell where they are) finds each group's prefix cached
    where it went."""
    prefixes = [f"Group {g} shares this preamble: " + " ".join(
        f"{w}{g}" for w in ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"] * 8)
        for g in range(4)]
    for name in replicas(served):  # from empty trees: the first round spreads by load
        r = http.post("/flush_cache", headers={REPLICA_HEADER: name})
        assert r.status_code == 200 and r.headers[REPLICA_HEADER] == name, r.text
    def pages(name: str) -> int:
        [router] = http.get("/ray/router").json()
        return router["replicas"][name]["cached_pages"]

    first = {}
    for g, prefix in enumerate(prefixes):
        r = http.post("/generate", json={"text": prefix + " first", "sampling_params": GREEDY})
        assert r.status_code == 200, r.text
        first[g] = name = r.headers[REPLICA_HEADER]
        # Its pages' events reach the router before the next call (a miss goes to the
        # emptier replica): at most a step and a heartbeat, longer on a loaded machine.
        seen = sum(1 for h in first.values() if h == name)
        wait_for(lambda name=name, seen=seen: pages(name) >= seen * 4, 30,
                 f"group {g}'s pages in the view")
    assert len(set(first.values())) == 2, (first, http.get("/ray/router").json())
    time.sleep(LINGER + 1)
    for g, prefix in enumerate(prefixes):
        r = http.post("/generate", json={"text": prefix + " second",
                                          "sampling_params": GREEDY})
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        assert r.headers[REPLICA_HEADER] == first[g], (g, first)
        assert meta["cached_tokens"] >= meta["prompt_tokens"] - 2 * 16, meta
    [router] = http.get("/ray/router").json()  # the ingress's one handle
    assert router["reasons"]["cache_hit"] >= 4, router
    views = router["replicas"].values()
    assert len(views) == 2 and all(v["synced"] and v["requests"] == 0 and v["tokens"] == 0
                                   for v in views), router  # every call's count released


def test_a_replica_whose_worker_dies_is_replaced_by_ray(served, http):
    """Its worker killed mid-stream: the stream in flight ends (an error, not a hang); the
    replica's health check fails (its server exits: max_worker_restarts=0), Ray starts
    another in its place, and calls are answered again, by both replicas."""
    before = replicas(served)
    victim, info = sorted(before.items())[0]
    with Client(info["rpc_address"], timeout=30) as c:
        worker = c.health()["pids"]["worker"]
    body = {"text": "A long story:", "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 1500, "ignore_eos": True}}
    start = time.monotonic()
    try:
        with http.stream("POST", "/generate", json=body, headers={REPLICA_HEADER: victim},
                         timeout=90) as s:
            lines = s.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(worker, signal.SIGKILL)
            tail = list(lines)
        assert not tail or tail[-1] != "data: [DONE]" or any("error" in t for t in tail)
    except httpx.HTTPError:
        pass  # the replica's server went away under the stream: it ended
    assert time.monotonic() - start < 90

    wait_for(lambda: victim not in (now := replica_actors()) and len(now) == 2, 240,
             "Ray replaced the replica")
    after = wait_for(lambda: replicas(served), 60, "the new replica answers")
    assert victim not in after and len({r["node"] for r in after.values()}) == 2
    for name in after:  # each replica answers, pinned or routed
        r = http.post("/generate", json={"text": "Back again", "sampling_params": GREEDY},
                      headers={REPLICA_HEADER: name})
        assert r.status_code == 200 and r.headers[REPLICA_HEADER] == name, r.text
    r = http.post("/generate", json={"text": "Routed again", "sampling_params": GREEDY})
    assert r.status_code == 200, r.text


def test_a_redeploy_drains_the_calls_in_flight(served, tiny):
    """Redeployed with one replica while each of the two runs a long stream (serve.run
    from Python is a new version: Ray starts the new replica, then stops the old ones):
    each replica Ray stops finishes its stream first (graceful shutdown), so both end
    whole, and the new replica answers."""
    from ray import serve

    from radixserve.ray import app

    new_tokens = 400
    body = {"text": "Count on:", "stream": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}}
    started = ThreadPoolExecutor(2)

    def stream(name: str) -> list[dict]:
        with httpx.Client(base_url=served, timeout=120) as c, c.stream(
                "POST", "/generate", json=body, headers={REPLICA_HEADER: name}) as s:
            events = [line[len("data: "):] for line in s.iter_lines()
                      if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        ended[name] = time.monotonic()
        return [json.loads(e) for e in events[:-1]]

    ended: dict[str, float] = {}

    names = sorted(replicas(served))
    runs = [started.submit(stream, name) for name in names]
    time.sleep(0.5)
    assert not any(run.done() for run in runs)
    scaled = time.monotonic()
    serve.run(app(app_args(tiny, num_replicas=1)), name=APP, route_prefix="/")
    for run in runs:
        last = run.result(timeout=120)[-1]
        assert last["meta_info"]["completion_tokens"] == new_tokens, last["meta_info"]
        assert last["meta_info"]["finish_reason"]["type"] == "length"
    stopped = set(names) - set(replica_actors())
    assert stopped and all(ended[n] - scaled > 1 for n in stopped), (stopped, ended, scaled)
    assert len(replica_actors()) == 1
    r = httpx.post(f"{served}/generate", json={"text": "Still here", "sampling_params": GREEDY},
                   timeout=60)
    assert r.status_code == 200, r.text


AUTOSCALED = {"num_replicas": "auto", "min_replicas": 1, "max_replicas": 2,
              "target_ongoing_requests": 1, "upscale_delay_s": 0, "downscale_delay_s": 1,
              "look_back_period_s": 1, "metrics_interval_s": 0.25,
              "scheduler_stall_seconds": 120}
"""Autoscaled between one replica and two on one call in flight per replica, at once, as
soon as a second's average says so; a replica's worker may be held (SIGSTOP) for a while
without its server calling itself stalled."""
BURST = 8


@pytest.mark.filterwarnings("ignore:The `metrics_interval_s`:DeprecationWarning")
def test_a_burst_scales_up_and_the_replica_ray_stops_finishes_its_call(cluster, served, tiny):
    """Redeployed autoscaled: one replica. Eight callers in a loop (calls queued or running
    per replica: 8, for a target of 1) make Ray start a second, which takes calls. Then the
    burst goes on at the head node's replica alone, and the other one (the one Ray stops
    first: off the head node) gets one long stream, held there: its worker stopped
    (SIGSTOP) before the call came, so that it cannot end before Ray decides. The burst
    ends: one call in flight, Ray scales down, and that replica is STOPPING while its
    stream is held. Let go, the stream ends whole, then Ray stops the replica: one left,
    all its KV blocks free. Every replica count is Ray's own (`serve.status()`)."""
    from ray import serve

    from radixserve.ray import app

    start = time.monotonic()
    trace: list[tuple[float, object]] = []  # Ray's counts as they change, and what we did

    def states() -> dict[str, int]:
        now = replica_states()
        last = [what for _, what in trace if isinstance(what, dict)][-1:]
        if last != [now]:
            trace.append((round(time.monotonic() - start, 1), now))
        return now

    def mark(what: str) -> None:
        trace.append((round(time.monotonic() - start, 1), what))

    serve.run(app(app_args(tiny, **AUTOSCALED)), name=APP, route_prefix="/")
    wait_for(lambda: states() == {"RUNNING": 1}, 60, "one replica, the minimum")
    [first] = replica_actors()

    pinned: dict[str, str] = {}  # once set, the burst's calls go to that replica
    switched: set[int] = set()
    stop = threading.Event()
    answers: list[httpx.Response] = []

    def burst(i: int) -> None:
        with httpx.Client(base_url=served, timeout=120) as c:
            for k in itertools.count():
                if stop.is_set():
                    return
                headers = dict(pinned)
                if headers:
                    switched.add(i)  # its calls before this one have ended
                answers.append(c.post("/generate", headers=headers, json={
                    "text": f"Burst call {i}.{k}: count the sheep", "sampling_params": {
                        "temperature": 0, "max_new_tokens": 32, "ignore_eos": True}}))

    long_tokens = 400

    def long_stream(name: str) -> list[str]:
        body = {"text": "A long story:", "stream": True, "sampling_params": {
            "temperature": 0, "max_new_tokens": long_tokens, "ignore_eos": True}}
        with httpx.Client(base_url=served, timeout=120) as c, c.stream(
                "POST", "/generate", json=body, headers={REPLICA_HEADER: name}) as s:
            assert s.status_code == 200
            events = [line[len("data: "):] for line in s.iter_lines()
                      if line.startswith("data: ")]
        mark("the long stream ended")
        return events

    pool = ThreadPoolExecutor(BURST + 1)
    mark(f"{BURST} callers start")
    runs = [pool.submit(burst, i) for i in range(BURST)]
    worker = None
    try:
        wait_for(lambda: states() == {"RUNNING": 2}, 120, "Ray scaled up to two replicas")
        nodes = replica_actors()
        assert len(set(nodes.values())) == 2, nodes
        [second] = set(nodes) - {first}
        [kept] = [n for n, node in nodes.items() if node == cluster.head_node.node_id]
        [drained] = set(nodes) - {kept}
        wait_for(lambda: any(a.headers.get(REPLICA_HEADER) == second for a in answers[:]),
                 60, "the new replica takes calls")

        pinned[REPLICA_HEADER] = kept
        wait_for(lambda: len(switched) == BURST, 60, "the burst's calls on one replica")
        with Client(replicas(served)[drained]["rpc_address"], timeout=30) as c:
            worker = c.health()["pids"]["worker"]
            os.kill(worker, signal.SIGSTOP)
            held = pool.submit(long_stream, drained)
            wait_for(lambda: (s := c.stats())["running"] or s["waiting"], 60,
                     "the long call held on its replica")
        mark("the long call held; the callers stop")
        stop.set()
        for run in runs:
            run.result(timeout=120)
        mark("the burst's calls answered")
        wait_for(lambda: states() == {"RUNNING": 1, "STOPPING": 1}, 60, "Ray scaling down")
        assert not held.done() and set(replica_actors()) == {kept, drained}  # draining
    finally:
        stop.set()
        if worker is not None:
            os.kill(worker, signal.SIGCONT)
            mark("let go")
        print("\nreplica states (s, serve.status()) and the test's steps:", trace)

    events = held.result(timeout=120)
    assert events[-1] == "[DONE]", events[-3:]
    meta = json.loads(events[-2])["meta_info"]
    assert meta["completion_tokens"] == long_tokens and \
        meta["finish_reason"]["type"] == "length", meta
    wait_for(lambda: states() == {"RUNNING": 1} and set(replica_actors()) == {kept}, 60,
             "down to one replica, the head node's")
    print("then:", trace[-2:], f"{len(answers)} burst calls")

    assert len(answers) >= BURST and all(a.status_code == 200 for a in answers), \
        [a.text for a in answers if a.status_code != 200][:3]
    for a in answers:
        assert a.json()["meta_info"]["completion_tokens"] == 32
        assert len(a.json()["output_ids"]) == 32
    assert {a.headers[REPLICA_HEADER] for a in answers} == {first, second}
    assert_server_idle(replicas(served)[kept]["rpc_address"])
