"""The attacks of one tenant on another and on the operator: bob aborting or reusing
alice's rid, calling the operator's calls, pinning past a quota, subscribing to the cache
events with no key; and the small ones: GET on state-changing routes, calls with no key or
a wrong one (issue 25, classes 5-8)."""

from __future__ import annotations

import json
import os
import uuid
from typing import Any, Callable, Iterator

import httpx
import zmq

from tools.soak.attacks.base import (
    OPERATOR_REFUSALS,
    REFUSAL_CODES,
    Attacker,
    http_outcome,
    rpc_outcome,
)
from tools.soak.outcome import Outcome, failed, refused, served
from radixserve.client import ServerError
from radixserve.messages import MAX_PIN_TTL


# -- 5. tenants -----------------------------------------------------------------------------
def rid_crossing(a: Attacker) -> list[tuple[str, Outcome]]:
    """alice streams a greedy case under her rid; after its first chunk bob aborts that
    rid (HTTP or RPC) or sends his own request under it (a batch slow to tokenize, so slow
    to refuse) and hangs up before its answer. alice's answer must come in full and right;
    bob's calls may be served or refused."""
    case = a.soak.case(a.rng)
    rid = f"soak-victim-{uuid.uuid4().hex}"
    how = a.rng.choice(["abort.http", "abort.rpc", "reuse.disconnect_stream",
                        "reuse.disconnect_plain"])
    kind = f"tenants.rid_{how}"
    bob: list[Outcome] = []

    def attack() -> None:
        http = a.http["bob"]
        if how == "abort.http":
            bob.append(http_outcome(http.post("/abort_request", json={"rid": rid}),
                                    serve=lambda r: served()))
        elif how == "abort.rpc":
            bob.append(rpc_outcome(lambda: a.rpc["bob"].abort(rid),
                                   serve=lambda r: served()))
        else:  # gone before the answer (or, streamed, its first event) comes
            prompt = "word " * min(a.soak.pool_tokens + 400, a.soak.args.max_prompt_chars // 5)
            body = {"text": [prompt] * 16, "rid": [rid, *(f"bob-{uuid.uuid4().hex}"
                                                           for _ in range(15))],
                    "sampling_params": {"max_new_tokens": 8}, "stream": how.endswith("stream")}
            # Gone while the front door tokenizes the batch (prompts longer than the pool:
            # never run), before it finds the rid taken.
            try:
                r = http.post("/generate", json=body, timeout=httpx.Timeout(
                    a.rng.uniform(0.001, 0.03), connect=10))
                bob.append(http_outcome(r, serve=lambda r: served()))
            except httpx.ReadTimeout:
                bob.append(served("hung up"))

    victim = victim_http if a.rng.random() < 0.5 else victim_rpc
    outcome = victim(a, case, rid, attack)
    return [(f"{kind}.bob", o) for o in bob] + [(kind, outcome)]


def victim_http(a: Attacker, case: Any, rid: str, attack: Callable[[], None]) -> Outcome:
    body = {"input_ids": case.ids, "sampling_params": case.params, "rid": rid,
            "stream": True}
    final: dict | None = None
    with a.http["alice"].stream("POST", "/generate", json=body,
                                timeout=a.soak.args.call_timeout) as r:
        if r.status_code != 200:
            r.read()
            return http_outcome(r, serve=lambda r: served())
        events = (json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]")
        first = next(events, None)
        attack()
        for event in [first, *events] if first is not None else []:
            if "error" in event:
                code = event["error"].get("code")
                return failed(code if isinstance(code, str) else "victim_error",
                              json.dumps(event)[:200])
            if event.get("meta_info", {}).get("finish_reason") is not None:
                final = event
    if final is None:
        return failed("victim_stream_cut", "alice's stream ended without a result")
    return judge_victim(case, final["output_ids"], final["meta_info"]["finish_reason"])


def victim_rpc(a: Attacker, case: Any, rid: str, attack: Callable[[], None]) -> Outcome:
    try:
        stream: Iterator[dict] = a.rpc["alice"].generate(
            input_ids=case.ids, sampling_params=case.params, rid=rid, stream=True,
            timeout=a.soak.args.call_timeout)
        first = next(stream)
        attack()
        final = first.get("final") or next(i["final"] for i in stream if "final" in i)
    except ServerError as e:
        return failed(e.code, e.message)
    except TimeoutError as e:
        return failed("no_answer", str(e))
    return judge_victim(case, final["output_ids"], final["meta_info"]["finish_reason"])


def judge_victim(case: Any, ids: list[int], finish: Any) -> Outcome:
    if isinstance(finish, dict) and finish.get("type") == "abort":
        return failed("victim_aborted", f"alice's stream ended after {len(ids)} tokens: "
                      f"{finish}")
    if ids != case.expected:
        return failed("victim_wrong_answer", f"{ids} != {case.expected}")
    return refused("alice's answer complete and right")


def operator_call(a: Attacker) -> list[tuple[str, Outcome]]:
    """bob tries what only the operator may do."""
    http, rpc = a.http["bob"], a.rpc["bob"]
    op = a.rng.choice(["flush", "cache_snapshot", "start_profile", "server_info", "workers"])
    over_rpc = op == "cache_snapshot" or (op != "server_info" and a.rng.random() < 0.5)
    kind = f"operator.{op}.{'rpc' if over_rpc else 'http'}"
    only_operator = lambda status, code: status in (401, 403)  # noqa: E731
    if op == "flush":
        o = (rpc_outcome(rpc.flush_cache, OPERATOR_REFUSALS) if over_rpc
             else http_outcome(http.post("/flush_cache"), refuse=only_operator))
    elif op == "cache_snapshot":
        o = rpc_outcome(rpc.cache_snapshot, OPERATOR_REFUSALS)
    elif op == "start_profile":
        where = os.path.join(a.outside, uuid.uuid4().hex, "trace")
        o = (rpc_outcome(lambda: rpc.start_profile(where)) if over_rpc
             else http_outcome(http.post("/start_profile", json={"output_dir": where})))
        if o.status != "refused":
            a.stop_profile()
        if os.path.exists(os.path.dirname(where)):
            o = failed("profile_dir_created", f"{where} made for a tenant ({o.detail})")
    elif op == "server_info":
        o = http_outcome(http.get("/get_server_info"), serve=lambda r: reduced_info(a, r))
    else:
        action = a.rng.choice(["list", "add"])
        url = "tcp://127.0.0.1:9" if action == "add" else None
        kind += f".{action}"
        o = (rpc_outcome(lambda: rpc.workers(action, url)) if over_rpc
             else http_outcome(http.post("/add_worker", params={"url": url})
                               if action == "add" else http.get("/list_workers")))
    return [(kind, o)]


def reduced_info(a: Attacker, r: httpx.Response) -> Outcome:
    """A tenant's /get_server_info: no key, not the other tenant's name, not the whole
    configuration."""
    text = r.text
    if any(k in text for k in [*a.keys.values(), a.soak.control_key]):
        return failed("leaked_key", "an API key in bob's server info")
    if "alice" in text:
        return failed("leaked_tenant", "alice's name in bob's server info")
    body = r.json()
    if isinstance(body, dict) and a.config_fields - {"api_key", "api_keys_file",
                                                     "admin_api_key"} <= body.keys():
        return failed("attack_accepted", "the full configuration, to a tenant")
    return served("a reduced server info")


def pin_quota(a: Attacker) -> list[tuple[str, Outcome]]:
    """bob pins fresh prefixes for ten years until refused (160 tokens at a time, then
    a page at a time, to fill his allowance to the brim); then alice must still be able
    to pin two pages. Both unpin everything after."""
    rng, out = a.rng, []
    try:
        o, size, pins = failed("attack_accepted", "bob pinned 60 prefixes"), 160, 0
        while pins < 60:
            ids = [rng.randrange(100, a.soak.vocab_size) for _ in range(size)]
            o = rpc_outcome(lambda: a.rpc["bob"].pin_prefix(
                input_ids=ids, ttl=MAX_PIN_TTL, timeout=a.timeout),  # noqa: B023
                serve=lambda r: served())
            pins += 1
            if o.status == "served":
                continue
            if o.status == "failed" or size == 16:
                break
            size = 16
        out.append(("tenants.pin_quota.bob", o if o.status != "served"
                    else failed("attack_accepted", "bob pinned 60 prefixes")))
        ids = [rng.randrange(100, a.soak.vocab_size) for _ in range(32)]
        try:
            a.rpc["alice"].pin_prefix(input_ids=ids, ttl=60.0, timeout=a.timeout)
            out.append(("tenants.pin_quota.alice", refused("alice could still pin")))
        except ServerError as e:
            # alice holds no pin: a limit she meets is one bob's pins filled
            crossed = "pinned" in e.message and "stayed cached" not in e.message
            out.append(("tenants.pin_quota.alice", failed("quota_crossed", e.message)
                        if crossed else Outcome("refused", detail=f"pool busy: {e.code}")
                        if e.code in REFUSAL_CODES else failed(e.code, e.message)))
        except TimeoutError as e:
            out.append(("tenants.pin_quota.alice", failed("no_answer", str(e))))
    finally:
        a.unpin_all()
    return out


def events_without_key(a: Attacker) -> list[tuple[str, Outcome]]:
    """Subscribe to the cache events with no key: nothing may arrive."""
    try:
        address = a.rpc_operator.model_info().get("cache_events_address")
    except (ServerError, TimeoutError) as e:
        return [("tenants.events_nokey", failed(getattr(e, "code", "no_answer"), str(e)))]
    if not address:
        return [("tenants.events_nokey", refused("no cache_events_address published"))]
    sock = a.ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(address)
    try:  # the scheduler publishes a heartbeat a second when idle
        got = sock.poll(5000)
    finally:
        sock.close(linger=0)
    return [("tenants.events_nokey", failed("attack_accepted", "cache events to no key")
             if got else refused("nothing published to a subscriber with no key"))]

# -- 6. smaller ones ------------------------------------------------------------------------
def small(a: Attacker) -> list[tuple[str, Outcome]]:
    which = a.rng.randrange(6)
    method_refused = lambda status, code: status in (404, 405)  # noqa: E731
    if which == 0:
        return [("small.get_flush_cache", http_outcome(
            a.http_operator.get("/flush_cache"), refuse=method_refused))]
    if which == 1:
        o = http_outcome(a.http_operator.get("/start_profile"), refuse=method_refused)
        if o.status != "refused":
            a.stop_profile()
        return [("small.get_start_profile", o)]
    if which == 2:
        return [("small.no_key.http", http_outcome(a.http_nokey.post(
            "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}}),
            refuse=lambda status, code: status == 401))]
    if which == 3:
        return [("small.no_key.rpc", rpc_outcome(lambda: a.rpc_nokey.generate(
            "hi", {"max_new_tokens": 1}, timeout=a.timeout), frozenset({"unauthorized"})))]
    if which == 4:
        return [("small.wrong_key.rpc", rpc_outcome(lambda: a.rpc_nokey.generate(
            "hi", {"max_new_tokens": 1}, api_key="not-a-key", timeout=a.timeout),
            frozenset({"unauthorized"})))]
    return [("small.no_key.stats_rpc", rpc_outcome(a.rpc_nokey.stats,
                                                   frozenset({"unauthorized"})))]
