"""The soak's attacker (issue 25): one thread that mixes hostile requests into the soak's
traffic, at a modest rate, as two tenants (`alice`, `bob`) and as nobody, over RPC and HTTP,
and classifies what each one got back; and the sentinel that ends the run if an attack
kills the server or grows it past the machine.

Each attack has an expected outcome: *refused* (a 4xx / `invalid_request` / `unauthorized` /
`forbidden` error within `--attack-timeout` seconds; some attacks accept only a narrower
set, named where they are), or *served* where the issue allows it (a template variable, a
pattern a linear-time matcher runs). Anything else is a failure: a 5xx, no answer in time,
a dropped connection, an attack the server carried out (`attack_accepted`: bob flushed the
cache, a caller's template was rendered), a server process restarted with no scheduled
kill to explain it (`server_restarted`), another tenant's stream ended (`victim_aborted`).
Failures `worker_died` / `not_ready` inside a worker kill's window are explained by it, as
for the rest of the traffic (bench/soak.py).

The groups (`--attacks`): counts (huge n, best_of, top_logprobs, batches), nesting (deep
msgpack over a raw DEALER, deep JSON over HTTP), template (a caller's Jinja template; a
template variable), regex (a backtracking `stop_regex` over a forced run of `a`s; bursts of
slow JSON-schema grammars), tenants (bob aborting or reusing alice's rid, bob calling the
operator's calls, pinning past a quota, subscribing to the cache events without a key),
small (GET on /flush_cache and /start_profile, calls with no key or a wrong one).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import tempfile
import threading
import time
import traceback
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import httpx
import msgspec
import psutil
import zmq

from radixserve.client import Client, ServerError
from radixserve.config import ServerConfig
from radixserve.messages import MAX_PIN_TTL, ErrorReply, RpcReply

if TYPE_CHECKING:
    from bench.soak import Soak

TENANTS = ("alice", "bob")
"""The soak's tenants (`--api-key KEY=alice --api-key KEY=bob`): bob attacks alice."""
GROUPS = ("counts", "nesting", "template", "regex", "tenants", "small")
HUGE = 1_000_000_000
REFUSAL_CODES = frozenset({"invalid_request", "unauthorized", "forbidden", "malformed_frame",
                           "frame_too_large"})
"""RPC error codes that refuse a caller's request; over HTTP, any 4xx with an error body."""
OPERATOR_REFUSALS = frozenset({"unauthorized", "forbidden"})
"""What an operator-only call made with a tenant's key must get: a 400 for flush (`requests
are still running`) means the tenant was allowed to try."""
DEEP = (1000, 4000)
"""Nesting depth of the deep frames and bodies (a frame of 1-4 KB)."""
GRAMMAR_BURST = 4
SLOW_SCHEMA_PROPERTIES = 10
"""Properties of a slow JSON schema, each a string `[a-z]{3,2000}`: some 1.5 s of xgrammar
compile each on an idle core of the reference machine (a burst compiled one after another
on the scheduler's loop stalls it for all that time)."""
CATASTROPHIC = "(a|aa)+b"
"""Backtracks exponentially in Python's `re` over a run of `a`s with no `b`."""
HEAVY_TEMPLATE = ("{% for i in range(3000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}"
                  "<|im_start|>user\n{{ messages[0]['content'] }}<|im_end|>\n"
                  "<|im_start|>assistant\n")
"""A caller's chat template: three million loop steps of Jinja, then a plain prompt."""


@dataclass
class Outcome:
    status: str
    """refused, served or failed."""
    reason: str = ""
    detail: str = ""


def refused(detail: str = "") -> Outcome:
    return Outcome("refused", detail=detail)


def served(detail: str = "") -> Outcome:
    return Outcome("served", detail=detail)


def failed(reason: str, detail: str = "") -> Outcome:
    return Outcome("failed", reason, detail[:300])


def http_outcome(r: httpx.Response, *, refuse: Callable[[int, str | None], bool] | None = None,
                 serve: Callable[[httpx.Response], Outcome] | None = None) -> Outcome:
    """A finished HTTP answer: refused if `refuse(status, code)` (default: a 4xx with an
    error body), served if `serve` is given and it is a 200 (`serve` judges it), else a
    failure named by the server's error code (worker_died, ...) or the status."""
    try:
        body = r.json()
    except ValueError:
        body = None
    err = body.get("error") if isinstance(body, dict) else None
    code = err.get("code") if isinstance(err, dict) else None
    code = code if isinstance(code, str) else None
    if refuse is not None and refuse(r.status_code, code):
        return refused(f"{r.status_code} {code or ''}".strip())
    if refuse is None and 400 <= r.status_code < 500 and isinstance(err, dict):
        return refused(f"{r.status_code} {code or ''}".strip())
    if r.status_code == 200:
        return serve(r) if serve is not None else failed("attack_accepted", r.text[:200])
    return failed(code or f"http_{r.status_code}", r.text[:200])


def rpc_outcome(call: Callable[[], Any], codes: frozenset[str] = REFUSAL_CODES,
                serve: Callable[[Any], Outcome] | None = None) -> Outcome:
    """An RPC call: refused if it fails with one of `codes`, served if `serve` is given
    (which judges the result), else a failure (`attack_accepted` if it succeeded)."""
    try:
        result = call()
    except ServerError as e:
        return refused(e.code) if e.code in codes else failed(e.code, e.message)
    except TimeoutError as e:
        return failed("no_answer", str(e))
    return serve(result) if serve is not None else failed("attack_accepted", repr(result)[:200])


def nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


class Attacker:
    """The attacks, and the identities and sockets they use. Each attack method returns
    [(kind, outcome)]; `run` picks them, records them in the soak's phase and checks after
    each that the server's processes are those it had (or a scheduled kill's)."""

    def __init__(self, soak: "Soak", seed: int) -> None:
        self.soak, self.rng = soak, random.Random(seed)
        a = soak.args
        self.timeout = a.attack_timeout
        self.keys: dict[str, str] = soak.keys
        self.rpc = {t: Client(soak.rpc_address, timeout=self.timeout, api_key=k)
                    for t, k in self.keys.items()}
        self.rpc_nokey = Client(soak.rpc_address, timeout=self.timeout)
        self.rpc_operator = Client(soak.rpc_address, timeout=self.timeout,
                                   api_key=soak.control_key)
        timeout = httpx.Timeout(self.timeout, connect=10.0)
        self.http = {t: httpx.Client(base_url=soak.http_url, timeout=timeout,
                                     headers={"Authorization": f"Bearer {k}"})
                     for t, k in self.keys.items()}
        self.http_nokey = httpx.Client(base_url=soak.http_url, timeout=timeout)
        self.http_operator = httpx.Client(base_url=soak.http_url, timeout=timeout, headers={
            "Authorization": f"Bearer {soak.control_key}"})
        self.ctx = zmq.Context()
        self.outside = tempfile.mkdtemp(prefix="radixserve-soak-attack-")
        """A folder of ours that a tenant names as the profiler's output_dir."""
        self.a_token: int = soak.a_token
        self.config_fields = {f.name for f in dataclasses.fields(ServerConfig)}
        groups = set(a.attacks)
        self.attacks: list[tuple[Callable[[], list[tuple[str, Outcome]]], float]] = [
            (fn, weight) for group, fn, weight in [
                ("counts", self.huge_count, 3), ("counts", self.huge_batch, 1),
                ("nesting", self.deep_rpc, 1.5), ("nesting", self.deep_http, 1.5),
                ("template", self.template, 2), ("regex", self.stop_regex, 1.5),
                ("regex", self.grammar_burst, 0.5), ("tenants", self.rid_crossing, 2),
                ("tenants", self.operator_call, 3), ("tenants", self.pin_quota, 0.5),
                ("tenants", self.events_without_key, 1), ("small", self.small, 2)]
            if group in groups]
        self.pids: dict[str, int] | None = None
        self.pids_at = time.monotonic()

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        soak, rng = self.soak, self.rng
        fns, weights = zip(*self.attacks)
        self.check_processes("start")
        while soak.running() and not soak.stop.wait(rng.uniform(0.5, 1.5) * soak.args.attack_every):
            fn = rng.choices(fns, weights)[0]
            soak.begin()
            soak.attack_in_flight = fn.__name__
            try:
                results = fn()
            except Exception as e:  # the soak's own bug: counted and shown, never hidden
                with soak.lock:
                    soak.client_errors += 1
                    show = soak.client_errors <= 5
                if show:
                    traceback.print_exception(e)
                results = [(f"{fn.__name__}", failed(f"client_exception:{type(e).__name__}",
                                                     repr(e)))]
            soak.attack_in_flight = None
            for kind, outcome in results:
                soak.record_attack(kind, outcome)
            self.check_processes(results[-1][0] if results else fn.__name__)

    def check_processes(self, kind: str) -> None:
        """A scheduler or worker pid that changed with no kill since the last look: the
        last attack crashed it (a restart the supervisor hid)."""
        try:
            pids = self.rpc_operator.health()["pids"]
        except (ServerError, TimeoutError):
            return  # restarting, or gone (the sentinel says which): look again next time
        now = time.monotonic()
        if self.pids is not None and pids != self.pids:
            killed = any(k >= self.pids_at - 1.0 for k, _ in self.soak.kill_windows)
            if not killed:
                self.soak.record_attack(kind, failed(
                    "server_restarted", f"pids {self.pids} -> {pids} with no scheduled kill"))
        self.pids, self.pids_at = pids, now

    def close(self) -> None:
        self.unpin_all()  # pins must not outlive the attacker: they hold blocks
        for c in [*self.rpc.values(), self.rpc_nokey, self.rpc_operator]:
            c.close()
        for h in [*self.http.values(), self.http_nokey, self.http_operator]:
            h.close()
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.outside, ignore_errors=True)

    def tenant(self) -> str:
        return self.rng.choice(sorted(self.keys))

    # -- 1. work sized by the caller ----------------------------------------------------------
    def huge_count(self) -> list[tuple[str, Outcome]]:
        t = self.tenant()
        http, rpc = self.http[t], self.rpc[t]
        chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1}
        which = self.rng.randrange(9)
        if which == 0:
            return [("counts.n.generate", http_outcome(http.post("/generate", json={
                "text": "hi", "sampling_params": {"n": HUGE, "max_new_tokens": 1}})))]
        if which == 1:
            return [("counts.n.completions", http_outcome(http.post("/v1/completions", json={
                "model": "default", "prompt": "hi", "n": HUGE, "max_tokens": 1})))]
        if which == 2:
            return [("counts.n.chat", http_outcome(http.post("/v1/chat/completions",
                                                             json={**chat, "n": HUGE})))]
        if which == 3:
            return [("counts.n.rpc", rpc_outcome(lambda: rpc.generate(
                "hi", {"n": HUGE, "max_new_tokens": 1}, timeout=self.timeout)))]
        if which == 4:
            return [("counts.best_of.completions", http_outcome(http.post(
                "/v1/completions", json={"model": "default", "prompt": "hi", "best_of": HUGE,
                                         "max_tokens": 1})))]
        if which == 5:
            return [("counts.top_logprobs.generate", http_outcome(http.post("/generate", json={
                "text": "hi", "return_logprob": True, "top_logprobs_num": HUGE,
                "sampling_params": {"max_new_tokens": 1}})))]
        if which == 6:
            return [("counts.top_logprobs.rpc", rpc_outcome(lambda: rpc.generate(
                "hi", {"max_new_tokens": 1}, return_logprob=True, top_logprobs_num=HUGE,
                timeout=self.timeout)))]
        if which == 7:
            return [("counts.top_logprobs.chat", http_outcome(http.post(
                "/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": HUGE})))]
        return [("counts.beam_width.generate", http_outcome(http.post("/generate", json={
            "text": "hi", "sampling_params": {"beam_width": HUGE, "max_new_tokens": 1}})))]

    def huge_batch(self) -> list[tuple[str, Outcome]]:
        """A batch far past any sane size: one whose last prompt is invalid (refused however
        big a batch may be), or one all valid (refused by a bound on the batch)."""
        t = self.tenant()
        which = self.rng.randrange(3)
        if which == 0:
            prompts = ["hi"] * 20_000 + ["word " * (self.soak.args.max_prompt_chars // 5 + 10)]
            return [("counts.batch_invalid_last.generate", http_outcome(self.http[t].post(
                "/generate", json={"text": prompts, "sampling_params": {"max_new_tokens": 1}})))]
        ids = [[1]] * 100_000
        if which == 1:
            ids = ids + [[self.soak.vocab_size + 7]]
            kind = "counts.batch_invalid_last.rpc"
        else:
            kind = "counts.batch_100k.rpc"
        return [(kind, rpc_outcome(lambda: self.rpc[t].generate(
            input_ids=ids, sampling_params={"max_new_tokens": 1}, timeout=self.timeout)))]

    # -- 2. deep nesting ----------------------------------------------------------------------
    def deep_rpc(self) -> list[tuple[str, Outcome]]:
        """A generate frame whose sampling_params.stop nests arrays thousands deep, as raw
        msgpack on a DEALER socket of our own."""
        marker = "\x00deep\x00"
        frame = msgspec.msgpack.encode({
            "type": "generate", "call_id": 7, "input_ids": [1, 2, 3],
            "sampling_params": {"stop": marker}, "api_key": self.keys[self.tenant()]})
        frame = frame.replace(msgspec.msgpack.encode(marker),
                              b"\x91" * self.rng.randint(*DEEP) + b"\x01")
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.soak.rpc_address)
        try:
            sock.send(frame)
            if not sock.poll(int(self.timeout * 1000)):
                return [("nesting.rpc", failed("no_answer", f"no reply in {self.timeout:g} s"))]
            reply = msgspec.msgpack.Decoder(RpcReply).decode(sock.recv())
        except msgspec.DecodeError as e:
            return [("nesting.rpc", failed("undecodable_reply", repr(e)))]
        finally:
            sock.close(linger=0)
        if isinstance(reply, ErrorReply):
            return [("nesting.rpc", refused(reply.code) if reply.code in REFUSAL_CODES
                     else failed(reply.code, reply.message))]
        return [("nesting.rpc", failed("attack_accepted", repr(reply)[:200]))]

    def deep_http(self) -> list[tuple[str, Outcome]]:
        deep = nested(self.rng.randint(*DEEP))
        if self.rng.random() < 0.5:
            kind, path = "nesting.http.generate", "/generate"
            body = '{"text": "hi", "sampling_params": {"stop": %s}}' % deep
        else:
            kind, path = "nesting.http.chat", "/v1/chat/completions"
            body = ('{"model": "default", "messages": [{"role": "user", "content": "hi"}], '
                    '"max_tokens": 1, "chat_template_kwargs": {"x": %s}}' % deep)
        return [(kind, http_outcome(self.http[self.tenant()].post(
            path, content=body.encode(), headers={"content-type": "application/json"})))]

    # -- 3. a caller's code ---------------------------------------------------------------------
    def template(self) -> list[tuple[str, Outcome]]:
        """A caller's template must be refused; a template variable may be served."""
        body = {"model": "default", "messages": [{"role": "user", "content": "Say hello."}],
                "max_tokens": 4, "temperature": 0}
        http = self.http[self.tenant()]
        if self.rng.random() < 0.6:
            return [("template.caller_template", http_outcome(http.post(
                "/v1/chat/completions",
                json={**body, "chat_template_kwargs": {"chat_template": HEAVY_TEMPLATE}})))]
        return [("template.variable", http_outcome(http.post(
            "/v1/chat/completions", json={**body, "chat_template_kwargs": {
                "enable_thinking": False, "soak_variable": "x"}}),
            serve=lambda r: served()))]

    # -- 4. matching work in the shared loops -----------------------------------------------------
    def stop_regex(self) -> list[tuple[str, Outcome]]:
        """`(a|aa)+b` over an output of `a`s (the token forced by logit_bias): a linear-time
        or bounded matcher serves it (or refuses the pattern); `re` stops every request."""
        params = {"max_new_tokens": 48, "ignore_eos": True, "temperature": 0,
                  "stop_regex": CATASTROPHIC, "logit_bias": {str(self.a_token): 100}}
        t = self.tenant()
        prompt = "Write the letter a many times: aaaaaaaa"
        if self.rng.random() < 0.5:
            return [("regex.stop_regex.rpc", rpc_outcome(
                lambda: self.rpc[t].generate(prompt, params, timeout=self.timeout),
                serve=lambda r: served()))]
        return [("regex.stop_regex.generate", http_outcome(self.http[t].post(
            "/generate", json={"text": prompt, "sampling_params": params}),
            serve=lambda r: served()))]

    def slow_schema(self) -> str:
        tag = uuid.uuid4().hex[:8]  # a new text each time: no grammar cache hit
        return json.dumps({"type": "object", "properties": {
            f"{tag}_{i}": {"type": "string", "pattern": "[a-z]{3,2000}"}
            for i in range(SLOW_SCHEMA_PROPERTIES)}})

    def grammar_burst(self) -> list[tuple[str, Outcome]]:
        """Several slow grammars at once: each compiles (served), or is refused (too slow,
        overloaded); none may stall the loop past the timeout or get a worker killed."""
        t = self.tenant()
        codes = REFUSAL_CODES | {"overloaded"}

        def one(_: int) -> Outcome:
            return rpc_outcome(lambda: self.rpc[t].generate(
                "hi", {"json_schema": self.slow_schema(), "max_new_tokens": 4},
                timeout=self.timeout), codes, serve=lambda r: served())

        with ThreadPoolExecutor(GRAMMAR_BURST) as pool:
            return [("regex.grammar_burst", o) for o in pool.map(one, range(GRAMMAR_BURST))]

    # -- 5. tenants -----------------------------------------------------------------------------
    def rid_crossing(self) -> list[tuple[str, Outcome]]:
        """alice streams a greedy case under her rid; after its first chunk bob aborts that
        rid (HTTP or RPC) or sends his own request under it (a long prompt, slow to refuse)
        and hangs up before its answer. alice's answer must come in full and right; bob's
        calls may be served or refused."""
        case = self.soak.case(self.rng)
        rid = f"soak-victim-{uuid.uuid4().hex}"
        how = self.rng.choice(["abort.http", "abort.rpc", "reuse.disconnect_stream",
                               "reuse.disconnect_plain"])
        kind = f"tenants.rid_{how}"
        bob: list[Outcome] = []

        def attack() -> None:
            http = self.http["bob"]
            if how == "abort.http":
                bob.append(http_outcome(http.post("/abort_request", json={"rid": rid}),
                                        serve=lambda r: served()))
            elif how == "abort.rpc":
                bob.append(rpc_outcome(lambda: self.rpc["bob"].abort(rid),
                                       serve=lambda r: served()))
            else:  # gone before the answer (or, streamed, its first event) comes
                body = {"text": "word " * (self.soak.args.max_prompt_chars // 5 - 10),
                        "rid": rid, "sampling_params": {"max_new_tokens": 8},
                        "stream": how.endswith("stream")}
                try:  # gone while the front door tokenizes, before it sees the rid taken
                    r = http.post("/generate", json=body, timeout=httpx.Timeout(
                        self.rng.uniform(0.001, 0.03), connect=10))
                    bob.append(http_outcome(r, serve=lambda r: served()))
                except httpx.ReadTimeout:
                    bob.append(served("hung up"))

        victim = self.victim_http if self.rng.random() < 0.5 else self.victim_rpc
        outcome = victim(case, rid, attack)
        return [(f"{kind}.bob", o) for o in bob] + [(kind, outcome)]

    def victim_http(self, case: Any, rid: str, attack: Callable[[], None]) -> Outcome:
        body = {"input_ids": case.ids, "sampling_params": case.params, "rid": rid,
                "stream": True}
        final: dict | None = None
        with self.http["alice"].stream("POST", "/generate", json=body,
                                       timeout=self.soak.args.call_timeout) as r:
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
        return self.judge_victim(case, final["output_ids"], final["meta_info"]["finish_reason"])

    def victim_rpc(self, case: Any, rid: str, attack: Callable[[], None]) -> Outcome:
        try:
            stream: Iterator[dict] = self.rpc["alice"].generate(
                input_ids=case.ids, sampling_params=case.params, rid=rid, stream=True,
                timeout=self.soak.args.call_timeout)
            first = next(stream)
            attack()
            final = first.get("final") or next(i["final"] for i in stream if "final" in i)
        except ServerError as e:
            return failed(e.code, e.message)
        except TimeoutError as e:
            return failed("no_answer", str(e))
        return self.judge_victim(case, final["output_ids"], final["meta_info"]["finish_reason"])

    @staticmethod
    def judge_victim(case: Any, ids: list[int], finish: Any) -> Outcome:
        if isinstance(finish, dict) and finish.get("type") == "abort":
            return failed("victim_aborted", f"alice's stream ended after {len(ids)} tokens: "
                          f"{finish}")
        if ids != case.expected:
            return failed("victim_wrong_answer", f"{ids} != {case.expected}")
        return refused("alice's answer complete and right")

    def operator_call(self) -> list[tuple[str, Outcome]]:
        """bob tries what only the operator may do."""
        http, rpc = self.http["bob"], self.rpc["bob"]
        op = self.rng.choice(["flush", "cache_snapshot", "start_profile", "server_info",
                              "workers"])
        over_rpc = op == "cache_snapshot" or (op != "server_info" and self.rng.random() < 0.5)
        kind = f"operator.{op}.{'rpc' if over_rpc else 'http'}"
        only_operator = lambda status, code: status in (401, 403)  # noqa: E731
        if op == "flush":
            o = (rpc_outcome(rpc.flush_cache, OPERATOR_REFUSALS) if over_rpc
                 else http_outcome(http.post("/flush_cache"), refuse=only_operator))
        elif op == "cache_snapshot":
            o = rpc_outcome(rpc.cache_snapshot, OPERATOR_REFUSALS)
        elif op == "start_profile":
            where = os.path.join(self.outside, uuid.uuid4().hex, "trace")
            o = (rpc_outcome(lambda: rpc.start_profile(where)) if over_rpc
                 else http_outcome(http.post("/start_profile", json={"output_dir": where})))
            if o.status != "refused":
                self.stop_profile()
            if os.path.exists(os.path.dirname(where)):
                o = failed("profile_dir_created", f"{where} made for a tenant ({o.detail})")
        elif op == "server_info":
            o = http_outcome(http.get("/get_server_info"), serve=self.reduced_info)
        else:
            action = self.rng.choice(["list", "add"])
            url = "tcp://127.0.0.1:9" if action == "add" else None
            kind += f".{action}"
            o = (rpc_outcome(lambda: rpc.workers(action, url)) if over_rpc
                 else http_outcome(http.post("/add_worker", params={"url": url})
                                   if action == "add" else http.get("/list_workers")))
        return [(kind, o)]

    def stop_profile(self) -> None:
        try:
            self.rpc_operator.stop_profile()
        except (ServerError, TimeoutError):
            pass

    def reduced_info(self, r: httpx.Response) -> Outcome:
        """A tenant's /get_server_info: no key, not the other tenant's name, not the whole
        configuration."""
        text = r.text
        if any(k in text for k in [*self.keys.values(), self.soak.control_key]):
            return failed("leaked_key", "an API key in bob's server info")
        if "alice" in text:
            return failed("leaked_tenant", "alice's name in bob's server info")
        body = r.json()
        if isinstance(body, dict) and self.config_fields - {"api_key", "api_keys_file",
                                                            "admin_api_key"} <= body.keys():
            return failed("attack_accepted", "the full configuration, to a tenant")
        return served("a reduced server info")

    def pin_quota(self) -> list[tuple[str, Outcome]]:
        """bob pins fresh prefixes for ten years until refused (160 tokens at a time, then
        a page at a time, to fill his allowance to the brim); then alice must still be able
        to pin two pages. Both unpin everything after."""
        rng, out = self.rng, []
        try:
            o, size, pins = failed("attack_accepted", "bob pinned 60 prefixes"), 160, 0
            while pins < 60:
                ids = [rng.randrange(100, self.soak.vocab_size) for _ in range(size)]
                o = rpc_outcome(lambda: self.rpc["bob"].pin_prefix(
                    input_ids=ids, ttl=MAX_PIN_TTL, timeout=self.timeout),
                    serve=lambda r: served())
                pins += 1
                if o.status == "served":
                    continue
                if o.status == "failed" or size == 16:
                    break
                size = 16
            out.append(("tenants.pin_quota.bob", o if o.status != "served"
                        else failed("attack_accepted", "bob pinned 60 prefixes")))
            ids = [rng.randrange(100, self.soak.vocab_size) for _ in range(32)]
            try:
                self.rpc["alice"].pin_prefix(input_ids=ids, ttl=60.0, timeout=self.timeout)
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
            self.unpin_all()
        return out

    def unpin_all(self) -> None:
        for client in self.rpc.values():
            try:
                client.unpin_all()
            except (ServerError, TimeoutError):
                pass  # restarting: a new scheduler has no pins

    def events_without_key(self) -> list[tuple[str, Outcome]]:
        """Subscribe to the cache events with no key: nothing may arrive."""
        try:
            address = self.rpc_operator.model_info().get("cache_events_address")
        except (ServerError, TimeoutError) as e:
            return [("tenants.events_nokey", failed(getattr(e, "code", "no_answer"), str(e)))]
        if not address:
            return [("tenants.events_nokey", refused("no cache_events_address published"))]
        sock = self.ctx.socket(zmq.SUB)
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
    def small(self) -> list[tuple[str, Outcome]]:
        which = self.rng.randrange(6)
        method_refused = lambda status, code: status in (404, 405)  # noqa: E731
        if which == 0:
            return [("small.get_flush_cache", http_outcome(
                self.http_operator.get("/flush_cache"), refuse=method_refused))]
        if which == 1:
            o = http_outcome(self.http_operator.get("/start_profile"), refuse=method_refused)
            if o.status != "refused":
                self.stop_profile()
            return [("small.get_start_profile", o)]
        if which == 2:
            return [("small.no_key.http", http_outcome(self.http_nokey.post(
                "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}}),
                refuse=lambda status, code: status == 401))]
        if which == 3:
            return [("small.no_key.rpc", rpc_outcome(lambda: self.rpc_nokey.generate(
                "hi", {"max_new_tokens": 1}, timeout=self.timeout), frozenset({"unauthorized"})))]
        if which == 4:
            return [("small.wrong_key.rpc", rpc_outcome(lambda: self.rpc_nokey.generate(
                "hi", {"max_new_tokens": 1}, api_key="not-a-key", timeout=self.timeout),
                frozenset({"unauthorized"})))]
        return [("small.no_key.stats_rpc", rpc_outcome(self.rpc_nokey.stats,
                                                       frozenset({"unauthorized"})))]


def attacker_thread(soak: "Soak", seed: int) -> None:
    attacker = Attacker(soak, seed)
    try:
        attacker.run()
    finally:
        attacker.close()


# -- the sentinel -------------------------------------------------------------------------------
class Sentinel:
    """Watches the server's process tree: if the front door exits, or the tree's RSS passes
    `max_rss_mib` (an attack growing it until the kernel would kill something, on a shared
    machine), it notes why (and the attack in flight), kills the tree in the second case,
    and stops the soak: the run then ends and reports instead of waiting on a dead server."""

    def __init__(self, soak: "Soak", root_pid: int, max_rss_mib: float) -> None:
        self.soak, self.root_pid, self.max_rss_mib = soak, root_pid, max_rss_mib

    def run(self, done: threading.Event, period: float = 0.5) -> None:
        while not done.wait(period):
            try:
                root = psutil.Process(self.root_pid)
                procs = [root, *root.children(recursive=True)]
                alive = root.status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                alive = False
            if not alive:
                return self.dead("the front door's process exited")
            rss = 0.0
            for p in procs:
                try:
                    rss += p.memory_info().rss / 2 ** 20
                except psutil.Error:
                    pass  # a child that ended since the listing (a killed worker)
            if rss > self.max_rss_mib:
                for p in procs:
                    try:
                        p.send_signal(signal.SIGKILL)
                    except psutil.Error:
                        pass
                return self.dead(f"the server's RSS reached {rss:.0f} MiB (over "
                                 f"--max-server-rss-mib {self.max_rss_mib:g}): killed")

    def dead(self, why: str) -> None:
        attack = self.soak.attack_in_flight
        self.soak.server_dead = why + (f", during attack {attack}" if attack else "")
        print(f"[soak] the server is gone: {self.soak.server_dead}", flush=True)
        self.soak.stop.set()


def summarize_attacks(phase: Any, in_kill_window: Callable[[float], bool],
                      explained_reasons: set[str]) -> dict[str, Any]:
    """Per attack kind: sent, refused as expected, served, failed explained by a worker
    kill, unexplained (with their reasons); and up to 30 unexplained examples."""
    table: dict[str, Counter] = {}
    examples = []
    for t, kind, outcome in phase.attacks:
        row = table.setdefault(kind, Counter())
        row["sent"] += 1
        if outcome.status != "failed":
            row[outcome.status] += 1
        elif outcome.reason in explained_reasons and in_kill_window(t):
            row["explained"] += 1
        else:
            row["unexplained"] += 1
            row[f"reason:{outcome.reason}"] += 1
            if len(examples) < 30:
                examples.append({"kind": kind, "reason": outcome.reason,
                                 "detail": outcome.detail})
    rows = {k: {"sent": c["sent"], "refused": c["refused"], "served": c["served"],
                "explained": c["explained"], "unexplained": c["unexplained"],
                "reasons": {r.removeprefix("reason:"): n for r, n in c.items()
                            if r.startswith("reason:")}}
            for k, c in sorted(table.items())}
    total = {f: sum(r[f] for r in rows.values())
             for f in ("sent", "refused", "served", "explained", "unexplained")}
    return {"by_kind": rows, "total": total, "unexplained_examples": examples}


def attack_table(a: dict[str, Any]) -> list[str]:
    """The markdown table of a phase's attacks."""
    lines = ["| attack | sent | refused as expected | served (allowed) | failed, a worker kill "
             "| **unexplained** (reasons) |", "|---|---|---|---|---|---|"]
    for kind, r in a["by_kind"].items():
        reasons = ", ".join(f"{k} {n}" for k, n in sorted(r["reasons"].items()))
        lines.append(f"| {kind} | {r['sent']} | {r['refused']} | {r['served']} | "
                     f"{r['explained']} | {r['unexplained']}" + (f" ({reasons})" if reasons
                                                                  else "") + " |")
    t = a["total"]
    lines.append(f"| **all** | {t['sent']} | {t['refused']} | {t['served']} | {t['explained']} "
                 f"| **{t['unexplained']}** |")
    return lines
