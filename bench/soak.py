"""Soak: the three-process server under mixed, hostile traffic for a bounded time, with its
worker killed every few minutes; every greedy answer checked against a reference.

Traffic, from several concurrent clients at once (loopback only):
- RPC `Client` threads and `AsyncClient` tasks: greedy and sampled generate calls, plain and
  streamed, with random aborts by rid mid-flight and streams abandoned mid-way;
- HTTP threads: SGLang-native `/generate` and OpenAI `/v1/chat/completions`, plain and
  streamed (server-sent events), with aborts (`/abort_request`) and clients that close the
  connection early (mid-stream, or before a plain answer);
- a chaos thread: malformed RPC frames on a raw ZeroMQ DEALER (garbage bytes, wrong field
  types, several parts, truncated frames, unknown call types), which must each be answered
  `malformed_frame` (bytes that are no msgpack call frame) or `invalid_request` (msgpack
  that fits no call, naming the field), and raw RPC clients that vanish mid-stream;
- invalid requests on every path (bad sampling parameters, unknown fields, a prompt longer
  than the KV pool, token ids outside the vocabulary, an empty prompt, a text prompt over
  `max_prompt_chars`, an unknown model), which must each be refused with a clear 4xx /
  `invalid_request`;
- a KV pool small enough that eviction and retraction happen all the time
  (`--max-total-tokens`), with the block invariant checked after every step
  (`debug_invariants`);
- a SIGKILL of the worker process every `--kill-every` seconds: calls in flight then fail
  with `worker_died` (and calls during the restart with `not_ready`), which is expected;
  the server must then serve again;
- an attacker thread (bench/soak_attacks/; issue 25), one attack every `--attack-every`
  seconds on average from the groups `--attacks` (counts, nesting, template, regex,
  tenants, small; all by default), each bounded by `--attack-timeout` seconds: huge `n` /
  `best_of` / `top_logprobs` / batches, frames and bodies nested thousands deep, a caller's
  chat template, a backtracking `stop_regex` and bursts of slow grammars, bob aborting or
  reusing alice's rid, bob calling the operator's calls, pinning past a quota or
  subscribing to the cache events, GET on /flush_cache and /start_profile, calls with no
  key. Each is refused as expected, served where the issue allows it, or an unexplained
  failure (a 5xx, no answer, a dropped connection, a server process restarted with no
  scheduled kill, alice's stream ended), which fails the run.

Tenants: the server has two tenant keys (`alice`, `bob`; the traffic's clients take turns)
and, where this commit's ServerConfig has `admin_api_key`, an operator key, which the idle
checks, flushes and the monitor use (else they use alice's key).

A sentinel thread watches the server's processes: if the front door exits, or their RSS
passes `--max-server-rss-mib` (an attack growing it; it is then killed, so that a shared
machine survives the run), the run stops and reports what it has, the dead server failing
the verdict.

Answers computed beforehand: a fixed set of greedy prompts (chat-formatted; several share a
long system prompt, so the radix cache and its eviction are exercised), whose outputs
transformers computes at start (fp32, one prompt at a time: `tests/hf_reference.py`). Each
case's length stops before the first step where the reference's top-2 logits are within
`TIE_GAP` (floating-point order may flip such a near-tie between batch shapes), so every
completed greedy answer must equal its reference exactly, on every path; an aborted one
must be a prefix of it. Sampled answers are only checked for well-formedness.

Every call has a timeout (`--call-timeout`); a call that gets no answer counts as a failure
`no_answer`. Failures `worker_died` / `not_ready` count as expected only inside a kill's
window (from the kill until the restarted server answers, plus a few seconds).

Figures (after a warm-up phase, so that the start figures are steady state; both measured
idle, after a cache flush, with only the control client connected): RSS and open file
descriptors of the server's process tree at start and end; KV blocks leaked (after the
final flush, `num_blocks - free_blocks`); requests sent, completed, failed by reason; wrong
answers; worker restarts survived; the scheduler's retractions and evictions over the run;
the attacks by kind: sent, refused as expected, served, failed in a kill's window,
unexplained. Pass: 0 wrong answers, 0 leaked blocks, RSS and fd growth < 5%, 0 unexpected
failures, 0 unexplained attack failures, every kill survived, the server alive at the end.

    python -m bench.soak --minutes 20                  # writes bench/results/soak.{json,md}
    python -m bench.soak --minutes 2 --kill-every 45 --warmup-seconds 20 --out /tmp/soak
    python -m bench.soak --minutes 2 --attacks tenants,small --attack-every 2 --out /tmp/soak

Not run by CI: it takes as long as it is told to.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

if __package__ in (None, ""):  # `python bench/soak.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
import msgspec  # noqa: E402
import psutil  # noqa: E402
import zmq  # noqa: E402

from bench.machine import machine_info, measure_limits  # noqa: E402
from bench.soak_attacks import (GROUPS, TENANTS, Outcome, Sentinel,  # noqa: E402
                                attack_table, attacker_thread, summarize_attacks)
from radixserve.client import AsyncClient, Client, ServerError  # noqa: E402
from radixserve.config import ServerConfig  # noqa: E402
from radixserve.messages import ChunkReply, ErrorReply, GenerateCall, ResultReply, RpcReply  # noqa: E402

TIE_GAP = 1e-4
"""As tests/hf_reference.py: a greedy choice between logits closer than this may flip."""
EXPECTED_IN_KILL_WINDOW = {"worker_died", "not_ready"}
"""Failure reasons a worker kill causes: calls in flight die, calls during the restart
are refused."""
KILL_WINDOW_GRACE_S = 3.0
BACKOFF_S = 0.5
"""After a kill's failure (or an HTTP connection that failed), each client waits this long
before its next call, as a real client would: a server that is restarting (or gone) refuses
at once, and clients that retry in a tight loop would only measure how fast it says so."""
"""A failure this long after the restarted server answered still counts as the kill's
(replies in transit, an HTTP stream's error event)."""

# -- the greedy cases --------------------------------------------------------------------
SYSTEM_A = (
    "You are the help desk of a regional railway company. Answer in a friendly tone and "
    "keep every answer short. Trains run every thirty minutes between six in the morning "
    "and midnight on weekdays, and every hour on weekends. A single ticket costs four euros "
    "within one zone and two euros more for each further zone. Children under six travel "
    "free; pupils and students pay half price with a valid card. Bicycles may be taken on "
    "board outside the rush hours, from nine to four and after seven in the evening, with "
    "a bicycle ticket of three euros. Dogs travel free if they are small enough to sit in "
    "a basket; larger dogs need a child's ticket and a muzzle. Lost property is kept for "
    "three months at the central station, open from eight to eight. Delays over an hour "
    "are refunded at a quarter of the fare, delays over two hours at half. Season tickets "
    "are sold by the month or by the year; the yearly ticket costs ten monthly ones. "
) * 2
SYSTEM_B = (
    "You are a careful cooking assistant. Give recipes as short numbered steps, name the "
    "quantities in grams and millilitres, and mention the oven temperature in Celsius. "
    "Never suggest raw eggs for children or pregnant people. When a question is not about "
    "food, say politely that you only help with cooking. Prefer seasonal vegetables, and "
    "offer a vegetarian variant whenever the recipe contains meat or fish. "
)
CASES: list[tuple[str | None, str, int]] = [
    (SYSTEM_A, "How much is a ticket for three zones?", 40),
    (SYSTEM_A, "Can I take my bicycle at eight in the morning?", 24),
    (SYSTEM_A, "My train was ninety minutes late. What do I get back?", 40),
    (SYSTEM_A, "Does my large dog need a ticket?", 16),
    (SYSTEM_A, "Where do I find a lost umbrella?", 32),
    (SYSTEM_B, "How do I make a simple tomato soup?", 40),
    (SYSTEM_B, "What can I bake with three apples?", 24),
    (SYSTEM_B, "Who won the football match yesterday?", 16),
    (None, "What is the capital of France?", 16),
    (None, "Write a haiku about the sea.", 32),
    (None, "List three prime numbers.", 12),
    (None, "Explain photosynthesis in one sentence.", 40),
]
"""(system prompt, question, desired length): the length is cut at the reference's first
near-tie."""


@dataclass(frozen=True)
class Case:
    name: str
    messages: list[dict[str, str]]
    text: str
    """The prompt as the chat template renders it (what /v1/chat/completions sends)."""
    ids: list[int]
    expected: list[int]
    answer: str
    """`expected` decoded as the server decodes (skip special tokens)."""
    desired: int

    @property
    def params(self) -> dict[str, Any]:
        return {"max_new_tokens": len(self.expected), "temperature": 0, "ignore_eos": True}


def build_cases(model_dir: Path, tokenizer: Any) -> tuple[list[Case], dict[str, Any]]:
    """Render the prompts as the chat route does and compute their greedy references with
    transformers, each cut before its first near-tie."""
    from radixserve.chat.prompt import render
    from radixserve.stop_strings import stop_decoder
    from tests.hf_reference import HFReference

    hf = HFReference(model_dir)
    decode = stop_decoder(tokenizer)
    cases, cut = [], {}
    for i, (system, question, desired) in enumerate(CASES):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": question}]
        text = render(tokenizer, messages, None)
        ids = tokenizer.encode(text)
        ref = hf.greedy(ids, desired)
        length = next((k for k, gap in enumerate(ref.gaps) if gap < TIE_GAP), desired)
        name = f"case{i}"
        if length < desired:
            cut[name] = length
        if length < 4:  # too short to say anything; a near-tie at once
            continue
        expected = ref.tokens[:length]
        cases.append(Case(name, messages, text, ids, expected, decode(expected, True, True),
                          desired))
    del hf
    gc.collect()
    info = {"cases": len(cases), "cut_at_near_tie": cut,
            "prompt_tokens": [len(c.ids) for c in cases],
            "output_tokens": [len(c.expected) for c in cases]}
    return cases, info


# -- bookkeeping -------------------------------------------------------------------------
@dataclass
class Failure:
    t: float
    kind: str
    reason: str
    detail: str


@dataclass
class Phase:
    """What one phase of traffic (warm-up or soak) sent and got back."""

    name: str
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    sent: Counter = field(default_factory=Counter)
    """Calls by kind (transport.action)."""
    outcomes: Counter = field(default_factory=Counter)
    """By status: completed, aborted, disconnected (by us, on purpose), refused (an invalid
    request or frame refused as it must be), failed, wrong."""
    failures: list[Failure] = field(default_factory=list)
    wrong: list[dict[str, Any]] = field(default_factory=list)
    attacks: list[tuple[float, str, Outcome]] = field(default_factory=list)
    """The attacker's (bench/soak_attacks/): (when, kind, what it got)."""
    output_tokens: int = 0
    greedy_checked: int = 0


class Soak:
    """Shared state of the traffic threads: the server's addresses, the cases, the
    current phase's counts, the stop flag and the kill windows."""

    def __init__(self, args: argparse.Namespace, rt: Any, cases: list[Case],
                 info: dict[str, Any]) -> None:
        self.args, self.rt, self.cases = args, rt, cases
        self.rpc_address: str = rt.rpc_address
        self.http_url: str = rt.http_url
        self.vocab_size: int = info["vocab_size"]
        self.pool_tokens: int = info["max_total_tokens"]
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.phase = Phase("none")
        self.begun = 0
        """Calls begun over the whole run, for `--max-requests`."""
        self.kill_windows: list[list[float]] = []
        """[kill time, time the server answered again] (the second open while restarting)."""
        self.client_errors = 0
        self.backoff_until = 0.0
        self.keys: dict[str, str] = info["keys"]
        """Tenant -> API key: the traffic's and the attacker's identities."""
        self.control_key: str = info["control_key"]
        """The operator's key (the tenants' first where the server has no operator key)."""
        self.a_token: int = info["a_token"]
        self.server_dead: str | None = None
        """Why the server is gone (the sentinel's finding), if it is."""
        self.attack_in_flight: str | None = None

    def key(self, i: int) -> str:
        """The i-th client's key: the tenants take turns."""
        return self.keys[sorted(self.keys)[i % len(self.keys)]]

    def record_attack(self, kind: str, outcome: Outcome) -> None:
        with self.lock:
            self.phase.attacks.append((time.monotonic(), kind, outcome))

    def backoff_s(self) -> float:
        """How long a client should wait before its next call (see BACKOFF_S)."""
        return max(0.0, self.backoff_until - time.monotonic())

    def running(self) -> bool:
        return not self.stop.is_set() and self.begun < self.args.max_requests

    def begin(self) -> None:
        with self.lock:
            self.begun += 1

    def record(self, kind: str, status: str, reason: str | None = None, detail: str = "",
               tokens: int = 0) -> None:
        with self.lock:
            p = self.phase
            p.sent[kind] += 1
            p.outcomes[status] += 1
            p.output_tokens += tokens
            if status == "failed":
                p.failures.append(Failure(time.monotonic(), kind, reason or "?", detail[:300]))

    def record_greedy(self, kind: str, case: Case, got: list[int] | str,
                      finish: Any, aborted_ok: bool = False) -> None:
        """Check a greedy answer (token ids, or text on the chat route) against the case."""
        expected: list[int] | str = case.answer if isinstance(got, str) else case.expected
        aborted = (finish == "abort" if isinstance(got, str)
                   else isinstance(finish, dict) and finish.get("type") == "abort")
        if aborted and aborted_ok:
            ok = expected[:len(got)] == got  # type: ignore[index]
            status = "aborted"
        else:
            want_finish = ("length" if isinstance(got, str)
                           else {"type": "length", "length": len(case.expected)})
            ok = got == expected and finish == want_finish
            status = "completed"
        with self.lock:
            self.phase.greedy_checked += 1
        if ok:
            self.record(kind, status, tokens=len(got) if not isinstance(got, str) else 0)
            return
        with self.lock:
            self.phase.wrong.append({"kind": kind, "case": case.name, "got": got,
                                     "expected": expected, "finish": finish})
        self.record(kind, "wrong", "wrong_answer")

    def fail(self, kind: str, reason: str, detail: str = "") -> None:
        if reason in EXPECTED_IN_KILL_WINDOW or reason.startswith("http_transport"):
            self.backoff_until = time.monotonic() + BACKOFF_S
        self.record(kind, "failed", reason, detail)

    def client_bug(self, kind: str, e: BaseException) -> None:
        """An exception the soak itself did not expect: counted, and printed (the first
        few) so that a bug here is not mistaken for the server's."""
        with self.lock:
            self.client_errors += 1
            show = self.client_errors <= 5
        if show:
            traceback.print_exception(e)
        self.fail(kind, f"client_exception:{type(e).__name__}", repr(e))

    def in_kill_window(self, t: float) -> bool:
        now = time.monotonic()
        return any(k <= t <= (r if r is not None else now) + KILL_WINDOW_GRACE_S
                   for k, r in self.kill_windows)

    def case(self, rng: random.Random) -> Case:
        return rng.choice(self.cases)

    def sampled_prompt(self, rng: random.Random) -> list[int]:
        """A prompt that shares a case's prefix, or random tokens (no sharing at all, to
        fill the pool), 16 to 640 tokens."""
        if rng.random() < 0.4:
            base = self.case(rng).ids
            return base + [rng.randrange(200, self.vocab_size) for _ in range(rng.randint(1, 64))]
        return [rng.randrange(200, self.vocab_size) for _ in range(rng.randint(16, 640))]

    def sampled_params(self, rng: random.Random) -> dict[str, Any]:
        params: dict[str, Any] = {"max_new_tokens": rng.randint(8, 128),
                                  "temperature": rng.choice([0.6, 0.8, 1.0, 1.3]),
                                  "top_p": rng.choice([1.0, 0.95, 0.8])}
        if rng.random() < 0.3:
            params["seed"] = rng.randrange(1 << 30)
        if rng.random() < 0.3:
            params["ignore_eos"] = True
        return params

    def check_sampled(self, kind: str, results: Any, params: dict[str, Any]) -> None:
        """Well-formed: a finish reason, as many tokens as it says, within the vocabulary
        and within max_new_tokens (exactly that many if it ended on length)."""
        problems = []
        tokens = 0
        for r in results if isinstance(results, list) else [results]:
            ids, meta = r.get("output_ids"), r.get("meta_info", {})
            finish = meta.get("finish_reason") or {}
            if not isinstance(ids, list) or not isinstance(r.get("text"), str):
                problems.append("no output_ids or text")
                continue
            tokens += len(ids)
            if finish.get("type") not in ("length", "stop"):
                problems.append(f"finish_reason {finish}")
            if meta.get("completion_tokens") != len(ids):
                problems.append(f"completion_tokens {meta.get('completion_tokens')} != {len(ids)}")
            if not all(0 <= t < self.vocab_size for t in ids):
                problems.append("token outside the vocabulary")
            limit = params["max_new_tokens"]
            if len(ids) > limit or (finish.get("type") == "length" and len(ids) != limit):
                problems.append(f"{len(ids)} tokens for max_new_tokens={limit}, {finish}")
        if problems:
            self.fail(kind, "bad_answer", "; ".join(problems))
        else:
            self.record(kind, "completed", tokens=tokens)


INVALID_PARAMS: list[dict[str, Any]] = [
    {"max_new_tokens": 8, "temperature": -1.0},
    {"max_new_tokens": 8, "top_p": 2.0},
    {"max_new_tokens": -5},
    {"max_new_tokens": 8, "no_such_parameter": 1},
    {"max_new_tokens": 8, "n": 0},
    {"max_new_tokens": 8, "stop": ["x" * 5000]},
]


def invalid_rpc_call(soak: Soak, rng: random.Random) -> dict[str, Any]:
    """Arguments of a generate call the server must refuse as invalid_request."""
    case = soak.case(rng)
    choice = rng.randrange(5)
    if choice == 0:
        return {"input_ids": case.ids, "sampling_params": rng.choice(INVALID_PARAMS)}
    if choice == 1:  # longer than the whole KV pool
        return {"input_ids": [100] * (soak.pool_tokens + 1), "sampling_params": {"max_new_tokens": 1}}
    if choice == 2:
        return {"input_ids": case.ids[:8] + [soak.vocab_size + 7], "sampling_params": {}}
    if choice == 3:
        return {"input_ids": [], "sampling_params": {}}
    return {"prompt": "word " * (soak.args.max_prompt_chars // 5 + 10),
            "sampling_params": {"max_new_tokens": 1}}


# -- RPC: Client threads -------------------------------------------------------------------
def rpc_thread(soak: Soak, client: Client, seed: int) -> None:
    rng = random.Random(seed)
    actions: list[tuple[Callable[[Soak, Client, random.Random], None], float]] = [
        (rpc_greedy, 4), (rpc_greedy_stream, 3), (rpc_sampled, 3), (rpc_sampled_stream, 2),
        (rpc_abort, 1.5), (rpc_invalid, 1)]
    fns, weights = zip(*actions)
    while soak.running():
        time.sleep(soak.backoff_s())
        fn = rng.choices(fns, weights)[0]
        soak.begin()
        try:
            fn(soak, client, rng)
        except Exception as e:
            soak.client_bug(f"rpc.{fn.__name__}", e)


def _server_failure(soak: Soak, kind: str, e: BaseException) -> None:
    if isinstance(e, ServerError):
        soak.fail(kind, e.code, e.message)
    elif isinstance(e, TimeoutError):
        soak.fail(kind, "no_answer", str(e))
    else:
        raise e


def rpc_greedy(soak: Soak, client: Client, rng: random.Random) -> None:
    case = soak.case(rng)
    prompt = {"prompt": case.text} if rng.random() < 0.3 else {"input_ids": case.ids}
    try:
        r = client.generate(**prompt, sampling_params=case.params, timeout=soak.args.call_timeout)
    except (ServerError, TimeoutError) as e:
        return _server_failure(soak, "rpc.greedy", e)
    if r["meta_info"]["prompt_tokens"] != len(case.ids):
        return soak.fail("rpc.greedy", "bad_answer", f"prompt_tokens {r['meta_info']}")
    soak.record_greedy("rpc.greedy", case, r["output_ids"], r["meta_info"]["finish_reason"])


def _read_rpc_stream(stream: Iterator[dict], stop_after: int | None = None
                     ) -> tuple[list[int], dict | None]:
    """Token ids of the chunks, and the final result (None if we stopped early)."""
    ids: list[int] = []
    for n, item in enumerate(stream):
        if "final" in item:
            return ids, item["final"]
        ids.extend(item["token_ids"])
        if stop_after is not None and n + 1 >= stop_after:
            return ids, None
    raise RuntimeError("the stream ended without a final result")


def rpc_greedy_stream(soak: Soak, client: Client, rng: random.Random) -> None:
    case = soak.case(rng)
    kind = "rpc.greedy_stream"
    try:
        ids, final = _read_rpc_stream(client.generate(
            input_ids=case.ids, sampling_params=case.params, stream=True,
            timeout=soak.args.call_timeout))
    except (ServerError, TimeoutError) as e:
        return _server_failure(soak, kind, e)
    assert final is not None
    if ids != final["output_ids"]:
        return soak.record_greedy(kind, case, ids, "chunks differ from the result")
    soak.record_greedy(kind, case, final["output_ids"], final["meta_info"]["finish_reason"])


def rpc_sampled(soak: Soak, client: Client, rng: random.Random) -> None:
    params = soak.sampled_params(rng)
    if rng.random() < 0.15:
        params["n"] = 2
    try:
        r = client.generate(input_ids=soak.sampled_prompt(rng), sampling_params=params,
                            timeout=soak.args.call_timeout)
    except (ServerError, TimeoutError) as e:
        return _server_failure(soak, "rpc.sampled", e)
    soak.check_sampled("rpc.sampled", r, params)


def rpc_sampled_stream(soak: Soak, client: Client, rng: random.Random) -> None:
    params = soak.sampled_params(rng)
    stream = client.generate(input_ids=soak.sampled_prompt(rng), sampling_params=params,
                             stream=True, timeout=soak.args.call_timeout)
    try:
        ids, final = _read_rpc_stream(stream)
    except (ServerError, TimeoutError) as e:
        return _server_failure(soak, "rpc.sampled_stream", e)
    assert final is not None
    if ids != final["output_ids"]:
        return soak.fail("rpc.sampled_stream", "bad_answer", "chunks differ from the result")
    soak.check_sampled("rpc.sampled_stream", final, params)


def rpc_abort(soak: Soak, client: Client, rng: random.Random) -> None:
    """A greedy call aborted by rid mid-flight: from another thread while a plain call
    waits, or between a stream's chunks. It ends aborted with a prefix of its answer, or
    complete if it finished first."""
    case = soak.case(rng)
    rid = f"soak-abort-{uuid.uuid4().hex}"
    kind = "rpc.abort_stream" if rng.random() < 0.5 else "rpc.abort"

    def abort() -> None:
        soak.begin()
        try:
            client.abort(rid)
            soak.record("rpc.abort_call", "completed")
        except (ServerError, TimeoutError) as e:
            _server_failure(soak, "rpc.abort_call", e)

    try:
        if kind == "rpc.abort":
            timer = threading.Timer(rng.uniform(0.05, 3.0), abort)
            timer.start()
            try:
                r = client.generate(input_ids=case.ids, sampling_params=case.params, rid=rid,
                                    timeout=soak.args.call_timeout)
            finally:
                timer.join()
        else:
            stream = client.generate(input_ids=case.ids, sampling_params=case.params, rid=rid,
                                     stream=True, timeout=soak.args.call_timeout)
            ids, final = _read_rpc_stream(stream, stop_after=rng.randint(1, 4))
            abort()
            if final is None:
                more, final = _read_rpc_stream(stream)
                ids += more
            assert final is not None
            if ids != final["output_ids"]:
                return soak.fail(kind, "bad_answer", "chunks differ from the result")
            r = final
    except (ServerError, TimeoutError) as e:
        return _server_failure(soak, kind, e)
    soak.record_greedy(kind, case, r["output_ids"], r["meta_info"]["finish_reason"],
                       aborted_ok=True)


def rpc_invalid(soak: Soak, client: Client, rng: random.Random) -> None:
    call = invalid_rpc_call(soak, rng)
    try:
        client.generate(**call, timeout=soak.args.call_timeout)
    except ServerError as e:
        if e.code == "invalid_request":
            return soak.record("rpc.invalid", "refused")
        return soak.fail("rpc.invalid", e.code, e.message)
    except TimeoutError as e:
        return soak.fail("rpc.invalid", "no_answer", str(e))
    soak.fail("rpc.invalid", "invalid_accepted", repr(call)[:200])


# -- RPC: AsyncClient tasks ----------------------------------------------------------------
def async_thread(soak: Soak, tasks: int, seed: int) -> None:
    async def main() -> None:
        client = AsyncClient(soak.rpc_address, timeout=soak.args.call_timeout,
                             api_key=soak.key(1))
        try:
            await asyncio.gather(*(async_loop(soak, client, random.Random(seed + i))
                                   for i in range(tasks)))
        finally:
            await client.close()

    asyncio.run(main())


async def async_loop(soak: Soak, client: AsyncClient, rng: random.Random) -> None:
    timeout = soak.args.call_timeout
    while soak.running():
        await asyncio.sleep(soak.backoff_s())
        soak.begin()
        action = rng.choices(["greedy", "stream", "sampled", "abort", "abandon", "invalid"],
                             [4, 3, 2, 1.5, 1, 1])[0]
        kind = f"async.{action}"
        case = soak.case(rng)
        try:
            if action == "greedy":
                r = await client.generate(input_ids=case.ids, sampling_params=case.params,
                                          timeout=timeout)
                soak.record_greedy(kind, case, r["output_ids"], r["meta_info"]["finish_reason"])
            elif action == "stream":
                ids: list[int] = []
                final = None
                async for item in client.generate_stream(
                        input_ids=case.ids, sampling_params=case.params, timeout=timeout):
                    if "final" in item:
                        final = item["final"]
                    else:
                        ids.extend(item["token_ids"])
                assert final is not None
                if ids != final["output_ids"]:
                    soak.fail(kind, "bad_answer", "chunks differ from the result")
                else:
                    soak.record_greedy(kind, case, final["output_ids"],
                                       final["meta_info"]["finish_reason"])
            elif action == "sampled":
                params = soak.sampled_params(rng)
                r = await client.generate(input_ids=soak.sampled_prompt(rng),
                                          sampling_params=params, timeout=timeout)
                soak.check_sampled(kind, r, params)
            elif action == "abort":
                rid = f"soak-async-abort-{uuid.uuid4().hex}"
                task = asyncio.ensure_future(client.generate(
                    input_ids=case.ids, sampling_params=case.params, rid=rid, timeout=timeout))
                await asyncio.sleep(rng.uniform(0.05, 3.0))
                soak.begin()
                try:
                    await client.abort(rid)
                    soak.record("async.abort_call", "completed")
                except (ServerError, TimeoutError) as e:
                    _server_failure(soak, "async.abort_call", e)
                r = await task
                soak.record_greedy(kind, case, r["output_ids"], r["meta_info"]["finish_reason"],
                                   aborted_ok=True)
            elif action == "abandon":  # leave a stream after a chunk or two: it is aborted
                gen = client.generate_stream(input_ids=case.ids, sampling_params=case.params,
                                             timeout=timeout)
                try:
                    got = 0
                    async for item in gen:
                        got += 1
                        if "final" in item or got >= rng.randint(1, 3):
                            break
                finally:
                    await gen.aclose()
                soak.record(kind, "disconnected")
            else:
                call = invalid_rpc_call(soak, rng)
                try:
                    await client.generate(**call, timeout=timeout)
                    soak.fail(kind, "invalid_accepted", repr(call)[:200])
                except ServerError as e:
                    if e.code == "invalid_request":
                        soak.record(kind, "refused")
                    else:
                        soak.fail(kind, e.code, e.message)
        except (ServerError, TimeoutError) as e:
            _server_failure(soak, kind, e)
        except Exception as e:
            soak.client_bug(kind, e)


# -- HTTP threads --------------------------------------------------------------------------
def http_thread(soak: Soak, seed: int, key: str) -> None:
    rng = random.Random(seed)
    actions: list[tuple[Callable[[Soak, httpx.Client, random.Random], None], float]] = [
        (http_generate, 3), (http_generate_stream, 3), (http_chat, 2), (http_chat_stream, 2),
        (http_sampled, 2), (http_abort, 1), (http_disconnect_stream, 1),
        (http_disconnect_plain, 0.7), (http_invalid, 1)]
    fns, weights = zip(*actions)
    timeout = httpx.Timeout(soak.args.call_timeout, connect=10.0)
    with httpx.Client(base_url=soak.http_url, timeout=timeout,
                      headers={"Authorization": f"Bearer {key}"}) as http:
        while soak.running():
            time.sleep(soak.backoff_s())
            fn = rng.choices(fns, weights)[0]
            soak.begin()
            kind = f"http.{fn.__name__.removeprefix('http_')}"
            try:
                fn(soak, http, rng)
            except httpx.TimeoutException as e:
                soak.fail(kind, "no_answer", repr(e))
            except httpx.TransportError as e:
                soak.fail(kind, f"http_transport:{type(e).__name__}", repr(e))
            except Exception as e:
                soak.client_bug(kind, e)


def _http_error(soak: Soak, kind: str, status: int, body: Any) -> None:
    """An error answer: its reason is the server's code (worker_died, not_ready, ...) when
    it names one, with the status."""
    err = body.get("error", {}) if isinstance(body, dict) else {}
    code = err.get("code") if isinstance(err, dict) else None
    reason = code if isinstance(code, str) else f"http_{status}"
    message = err.get("message", "") if isinstance(err, dict) else str(body)
    soak.fail(kind, reason, f"{status}: {message}")


def _json(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return {"error": {"message": r.text[:200]}}


def _sse(lines: Iterator[str]) -> Iterator[Any]:
    """The JSON payloads of a server-sent event stream; the string "[DONE]" at its end."""
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            yield data if data == "[DONE]" else json.loads(data)


def _generate_body(case: Case, rng: random.Random, stream: bool, **extra: Any) -> dict:
    prompt = {"text": case.text} if rng.random() < 0.3 else {"input_ids": case.ids}
    return {**prompt, "sampling_params": case.params, "stream": stream, **extra}


def http_generate(soak: Soak, http: httpx.Client, rng: random.Random) -> None:
    case = soak.case(rng)
    r = http.post("/generate", json=_generate_body(case, rng, False))
    body = _json(r)
    if r.status_code != 200:
        return _http_error(soak, "http.generate", r.status_code, body)
    soak.record_greedy("http.generate", case, body["output_ids"],
                       body["meta_info"]["finish_reason"])


def http_generate_stream(soak: Soak, http: httpx.Client, rng: random.Random) -> None:
    case = soak.case(rng)
    kind = "http.generate_stream"
    with http.stream("POST", "/generate", json=_generate_body(case, rng, True)) as r:
        if r.status_code != 200:
            r.read()
            return _http_error(soak, kind, r.status_code, _json(r))
        ids, final, error = _read_generate_stream(r.iter_lines(), None)
    if error is not None or final is None:
        return _http_error(soak, kind, 200, error or {"error": {"message": "no result"}})
    if ids and ids != final["output_ids"][:len(ids)]:
        return soak.fail(kind, "bad_answer", "chunks differ from the result")
    soak.record_greedy(kind, case, final["output_ids"], final["meta_info"]["finish_reason"])


def _chat_body(case: Case, stream: bool) -> dict:
    return {"model": "default", "messages": case.messages, "max_tokens": len(case.expected),
            "temperature": 0, "ignore_eos": True, "stream": stream}


def http_chat(soak: Soak, http: httpx.Client, rng: random.Random) -> None:
    case = soak.case(rng)
    r = http.post("/v1/chat/completions", json=_chat_body(case, False))
    body = _json(r)
    if r.status_code != 200:
        return _http_error(soak, "http.chat", r.status_code, body)
    usage = body["usage"]
    if usage["prompt_tokens"] != len(case.ids) or usage["completion_tokens"] != len(case.expected):
        return soak.record_greedy("http.chat", case, f"usage {usage}", "?")
    choice = body["choices"][0]
    soak.record_greedy("http.chat", case, choice["message"]["content"], choice["finish_reason"])


def http_chat_stream(soak: Soak, http: httpx.Client, rng: random.Random) -> None:
    case = soak.case(rng)
    kind = "http.chat_stream"
    text, finish, error, done = "", None, None, False
    with http.stream("POST", "/v1/chat/completions", json=_chat_body(case, True)) as r:
        if r.status_code != 200:
            r.read()
            return _http_error(soak, kind, r.status_code, _json(r))
        for event in _sse(r.iter_lines()):
            if event == "[DONE]":
                done = True
                break
            if "error" in event:
                error = event
                continue
            for choice in event["choices"]:
                text += choice["delta"].get("content") or ""
                finish = choice["finish_reason"] or finish
    if error is not None:
        return _http_error(soak, kind, 200, error)
    if not done:
        return soak.fail(kind, "stream_cut", "the event stream ended without [DONE]")
    soak.record_greedy(kind, case, text, finish)


def http_sampled(soak: Soak, http: httpx.Client, rng: random.Random) -> None:
    params = soak.sampled_params(rng)
    r = http.post("/generate", json={"input_ids": soak.sampled_prompt(rng),
                                     "sampling_params": params})
    body = _json(r)
    if r.status_code != 200:
        return _http_error(soak, "http.sampled", r.status_code, body)
    soak.check_sampled("http.sampled", body, params)


def http_abort(soak: Soak, http: httpx.Client, rng: random.Random) -> None:
    """A streamed greedy /generate aborted with /abort_request after a chunk or few."""
    case = soak.case(rng)
    rid = f"soak-http-abort-{uuid.uuid4().hex}"
    kind = "http.abort"
    with http.stream("POST", "/generate", json=_generate_body(case, rng, True, rid=rid)) as r:
        if r.status_code != 200:
            r.read()
            return _http_error(soak, kind, r.status_code, _json(r))
        lines = r.iter_lines()
        ids, final, error = _read_generate_stream(lines, rng.randint(1, 4))
        soak.begin()
        a = http.post("/abort_request", json={"rid": rid}, timeout=30)
        if a.status_code == 200:
            soak.record("http.abort_call", "completed")
        else:
            _http_error(soak, "http.abort_call", a.status_code, _json(a))
        if final is None and error is None:
            ids, final, error = _read_generate_stream(lines, None, ids)
    if error is not None or final is None:
        return _http_error(soak, kind, 200, error or {"error": {"message": "no result"}})
    soak.record_greedy(kind, case, final["output_ids"], final["meta_info"]["finish_reason"],
                       aborted_ok=True)


def _read_generate_stream(lines: Iterator[str], stop_after: int | None,
                               ids: list[int] | None = None
                               ) -> tuple[list[int], dict | None, dict | None]:
    """A /generate event stream, from an iterator of its lines that may be resumed:
    (the last chunk's cumulative ids, the final result, an error event), stopping after
    `stop_after` chunks if given. A stream cut short is an error `stream_cut`."""
    ids = ids or []
    n = 0
    for event in _sse(lines):
        if event == "[DONE]":
            return ids, None, _cut("[DONE] without a result")
        if "error" in event:
            return ids, None, event
        if event["meta_info"].get("finish_reason") is not None:
            if "[DONE]" not in _sse(lines):  # the result is the last event before it
                return ids, None, _cut("no [DONE] after the result")
            return ids, event, None
        ids = event["output_ids"]
        n += 1
        if stop_after is not None and n >= stop_after:
            return ids, None, None
    return ids, None, _cut("the event stream ended without [DONE]")


def _cut(message: str) -> dict[str, Any]:
    return {"error": {"code": "stream_cut", "message": message}}


def http_disconnect_stream(soak: Soak, http: httpx.Client, rng: random.Random) -> None:
    """Read a chunk or few of a stream (greedy /generate or chat), then close the
    connection: the server must abort the request and free its blocks."""
    case = soak.case(rng)
    kind = "http.disconnect_stream"
    path, body = (("/generate", _generate_body(case, rng, True)) if rng.random() < 0.6
                  else ("/v1/chat/completions", _chat_body(case, True)))
    with http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            r.read()
            return _http_error(soak, kind, r.status_code, _json(r))
        want = rng.randint(1, 3)
        for n, _ in enumerate(_sse(r.iter_lines())):
            if n + 1 >= want:
                break
        # Leaving the block unread closes the connection (httpx does not reuse it).
    soak.record(kind, "disconnected")


def http_disconnect_plain(soak: Soak, http: httpx.Client, rng: random.Random) -> None:
    """A plain /generate whose client gives up before the answer (a short read timeout
    closes the connection); if the answer comes first, it is checked."""
    case = soak.case(rng)
    kind = "http.disconnect_plain"
    try:
        r = http.post("/generate", json=_generate_body(case, rng, False),
                      timeout=httpx.Timeout(rng.uniform(0.2, 2.0), connect=10.0))
    except httpx.ReadTimeout:
        return soak.record(kind, "disconnected")
    body = _json(r)
    if r.status_code != 200:
        return _http_error(soak, kind, r.status_code, body)
    soak.record_greedy(kind, case, body["output_ids"], body["meta_info"]["finish_reason"])


def http_invalid(soak: Soak, http: httpx.Client, rng: random.Random) -> None:
    """A request the server must refuse with a 4xx naming the problem."""
    case = soak.case(rng)
    choice = rng.randrange(7)
    if choice <= 1:
        call = invalid_rpc_call(soak, rng)
        body: Any = {("text" if k == "prompt" else k): v for k, v in call.items()}
        path = "/generate"
    elif choice == 2:
        path, body = "/v1/chat/completions", {**_chat_body(case, rng.random() < 0.5),
                                              "temperature": -2}
    elif choice == 3:
        path, body = "/v1/chat/completions", {**_chat_body(case, False), "model": "no-such-model"}
    elif choice == 4:
        path, body = "/generate", {"input_ids": case.ids, "no_such_field": True}
    elif choice == 5:
        path, body = "/v1/chat/completions", {**_chat_body(case, False), "messages": []}
    else:
        path, body = "/generate", None  # not JSON at all
    if body is None:
        r = http.post(path, content=b"{not json", headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    if 400 <= r.status_code < 500:
        err = _json(r).get("error")
        if isinstance(err, dict) and err.get("message"):
            return soak.record("http.invalid", "refused")
        return soak.fail("http.invalid", "unclear_refusal", r.text[:200])
    if r.status_code == 200:
        return soak.fail("http.invalid", "invalid_accepted", f"{path} {str(body)[:200]}")
    _http_error(soak, "http.invalid", r.status_code, _json(r))


# -- chaos: malformed frames and vanishing raw clients --------------------------------------
MALFORMED_CODES = {"wrong_types": {"invalid_request"}, "unknown_call": {"invalid_request"},
                   "random_bytes": {"malformed_frame", "invalid_request"}}
"""The errors a malformed call of each kind may be answered with: msgpack that fits no call
is an `invalid_request` naming the field (random bytes now and then are such msgpack, a
lone small integer say); anything else `malformed_frame`."""


def malformed_frames(rng: random.Random) -> tuple[str, list[bytes]]:
    """One malformed call (its kind, its frames)."""
    enc = msgspec.msgpack.encode
    valid = msgspec.msgpack.Encoder().encode(GenerateCall(
        call_id=rng.randrange(1, 1 << 30), input_ids=[1, 2, 3], sampling_params={}))
    choice = rng.randrange(7)
    if choice == 0:
        return "garbage", [b"\xc1" + os.urandom(rng.randint(0, 256))]  # 0xc1: never msgpack
    if choice == 1:
        return "random_bytes", [os.urandom(rng.randint(1, 512))]
    if choice == 2:
        return "wrong_types", [enc({"type": "generate", "call_id": 77, "input_ids": "abc",
                                    "sampling_params": 5})]
    if choice == 3:
        return "multipart", [valid, b"extra", b"more"]
    if choice == 4:
        return "truncated", [valid[:rng.randint(1, len(valid) - 1)]]
    if choice == 5:
        return "empty", [b""]
    return "unknown_call", [enc({"type": "self_destruct", "call_id": 78})]


def chaos_thread(soak: Soak, seed: int) -> None:
    rng = random.Random(seed)
    ctx = zmq.Context()
    decoder = msgspec.msgpack.Decoder(RpcReply)
    try:
        while soak.running():
            soak.begin()
            if rng.random() < 0.75:
                kind, frames = malformed_frames(rng)
                raw_malformed(soak, ctx, decoder, kind, frames)
            else:
                raw_vanish(soak, ctx, decoder, rng)
            soak.stop.wait(rng.uniform(0.2, 2.0))
    finally:
        ctx.destroy(linger=0)


def _raw_socket(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def raw_malformed(soak: Soak, ctx: zmq.Context, decoder: Any, chaos: str,
                  frames: list[bytes]) -> None:
    kind = f"chaos.{chaos}"
    sock = _raw_socket(ctx, soak.rpc_address)
    try:
        sock.send_multipart(frames)
        if not sock.poll(30_000):
            return soak.fail(kind, "no_answer", "no reply to a malformed frame in 30 s")
        reply = decoder.decode(sock.recv())
        if isinstance(reply, ErrorReply) and reply.code in MALFORMED_CODES.get(
                chaos, {"malformed_frame"}):
            return soak.record(kind, "refused")
        soak.fail(kind, "malformed_accepted", repr(reply)[:200])
    except msgspec.DecodeError as e:
        soak.fail(kind, "undecodable_reply", repr(e))
    finally:
        sock.close(linger=0)


def raw_vanish(soak: Soak, ctx: zmq.Context, decoder: Any, rng: random.Random) -> None:
    """A raw client that starts a stream, reads its first chunk and disappears without an
    abort: the front door must notice when its next reply cannot be delivered."""
    kind = "chaos.vanish"
    case = soak.case(rng)
    sock = _raw_socket(ctx, soak.rpc_address)
    try:
        sock.send(msgspec.msgpack.Encoder().encode(GenerateCall(
            call_id=1, input_ids=case.ids, stream=True, rid=f"soak-vanish-{uuid.uuid4().hex}",
            api_key=soak.key(0),
            sampling_params={**case.params, "max_new_tokens": 64})))
        if not sock.poll(int(soak.args.call_timeout * 1000)):
            return soak.fail(kind, "no_answer", "no first chunk")
        reply = decoder.decode(sock.recv())
        if isinstance(reply, ErrorReply):
            return soak.fail(kind, reply.code, reply.message)
        if not isinstance(reply, (ChunkReply, ResultReply)):
            return soak.fail(kind, "bad_answer", repr(reply)[:200])
        soak.record(kind, "disconnected")
    finally:
        sock.close(linger=0)


# -- the worker killer and the monitor --------------------------------------------------
def wait_serving(control: Client, old_worker: int | None, timeout: float,
                 stop: threading.Event) -> dict | None:
    """Health once the server is ok (with a new worker pid if `old_worker`), else None
    (also once `stop` is set: the run is over)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop.is_set():
        try:
            h = control.health()
            if h["status"] == "ok" and h["pids"]["worker"] != old_worker:
                return h
        except (ServerError, TimeoutError):
            pass
        time.sleep(0.2)
    return None


def killer_thread(soak: Soak, control: Client, every: float, until: float,
                  restarts: list[dict[str, Any]]) -> None:
    """SIGKILL the worker every `every` seconds, but none in the last `every` seconds (at
    least a minute), so that the worker measured at the end has served a while, as the one
    measured at the start had; after each kill, wait for the server to serve again and
    check that it answers a greedy case right."""
    next_kill = time.monotonic() + every
    while not soak.stop.wait(max(0.0, next_kill - time.monotonic())):
        if time.monotonic() > until - max(60.0, every):
            return
        try:
            pids = control.health()["pids"]
        except (ServerError, TimeoutError):
            return  # the server is gone or hung: the sentinel or the counts say which
        window = [time.monotonic(), None]
        with soak.lock:
            soak.kill_windows.append(window)  # type: ignore[arg-type]
        os.kill(pids["worker"], signal.SIGKILL)
        health = wait_serving(control, pids["worker"], 300, soak.stop)
        window[1] = time.monotonic()
        entry: dict[str, Any] = {"at_s": round(window[0] - soak.phase.started, 1),
                                 "killed_pid": pids["worker"],
                                 "restart_s": round(window[1] - window[0], 2),
                                 "served_again": health is not None}
        if health is not None:
            case = soak.cases[0]
            try:
                r = control.generate(input_ids=case.ids, sampling_params=case.params,
                                     timeout=soak.args.call_timeout)
                entry["probe_correct"] = r["output_ids"] == case.expected
            except (ServerError, TimeoutError) as e:
                entry["probe_correct"] = False
                entry["probe_error"] = repr(e)
            entry["new_pids"] = health["pids"]
        restarts.append(entry)
        print(f"[soak] worker kill {len(restarts)}: {entry}", flush=True)
        if health is None:
            soak.stop.set()  # nothing more to learn from a server that does not come back
            return
        next_kill += every


class Monitor:
    """Polls the scheduler's counters every few seconds and adds them up across restarts
    (a restarted scheduler counts from zero), and samples the tree's RSS and fds."""

    COUNTERS = ("retractions", "evicted_tokens", "steps", "prefill_tokens", "decode_tokens",
                "prompt_tokens", "prompt_cached_tokens", "finished", "aborted")

    def __init__(self, control: Client, root_pid: int) -> None:
        self.control, self.root_pid = control, root_pid
        self.base = Counter()
        self.last: dict[str, int] = {}
        self.peak_pool_usage = 0.0
        self.peak_running = self.peak_waiting = 0
        self.samples: list[dict[str, Any]] = []
        self.t0 = time.monotonic()

    def poll(self) -> None:
        try:
            s = self.control.stats()
        except (ServerError, TimeoutError):
            return  # restarting
        if s["steps"] < self.last.get("steps", 0):  # a new scheduler
            self.base.update(self.last)
        self.last = {k: int(s.get(k, 0)) for k in self.COUNTERS}
        self.peak_pool_usage = max(self.peak_pool_usage, s["pool_usage"])
        self.peak_running = max(self.peak_running, s["running"])
        self.peak_waiting = max(self.peak_waiting, s["waiting"])

    def totals(self) -> dict[str, int]:
        return {k: self.base[k] + self.last.get(k, 0) for k in self.COUNTERS}

    def run(self, stop: threading.Event, period: float = 5.0) -> None:
        n = 0
        while not stop.wait(period):
            self.poll()
            n += 1
            if n % 6 == 0:  # every 30 s
                try:
                    tree = process_tree(self.root_pid, self.names())
                except psutil.Error:
                    continue  # the server is gone (the sentinel says why)
                self.samples.append({"t_s": round(time.monotonic() - self.t0, 1),
                                     "rss_mib": tree["rss_mib"], "fds": tree["fds"],
                                     "load_1m": round(os.getloadavg()[0], 2),
                                     "rss_mib_each": {name: p["rss_mib"] for name, p
                                                      in tree["processes"].items()}})

    def names(self) -> dict[int, str]:
        try:
            return names_of(self.control)
        except (ServerError, TimeoutError):
            return {}


def process_tree(root_pid: int, names: dict[int, str] | None = None) -> dict[str, Any]:
    """RSS (MiB) and open file descriptors of the server's processes, summed and each."""
    root = psutil.Process(root_pid)
    procs = [root, *root.children(recursive=True)]
    each = {}
    rss = fds = 0
    for p in procs:
        try:
            r, f = p.memory_info().rss, p.num_fds()
        except psutil.NoSuchProcess:
            continue
        rss, fds = rss + r, fds + f
        each[(names or {}).get(p.pid, f"pid {p.pid}")] = {
            "pid": p.pid, "rss_mib": round(r / 2 ** 20, 1), "fds": f}
    return {"rss_mib": round(rss / 2 ** 20, 1), "fds": fds, "processes": each}


# -- phases ------------------------------------------------------------------------------
def run_traffic(soak: Soak, phase: Phase, seconds: float, kill_every: float | None,
                monitor: Monitor, control: Client) -> list[dict[str, Any]]:
    """Run every traffic thread for `seconds` (or until `--max-requests`), the killer too
    if `kill_every`, the attacker if `--attack-every`; then stop and wait for every call to
    end (or for the sentinel to find the server gone). Returns the restarts."""
    a = soak.args
    phase.started = time.monotonic()
    soak.phase = phase
    soak.stop.clear()
    until = time.monotonic() + seconds
    clients = [Client(soak.rpc_address, timeout=a.call_timeout, api_key=key)
               for key in (soak.key(i) for i in range(len(soak.keys)))]
    threads = [threading.Thread(target=rpc_thread,
                                args=(soak, clients[i % len(clients)], a.seed * 1000 + i),
                                name=f"rpc-{i}") for i in range(a.rpc_threads)]
    threads += [threading.Thread(target=http_thread,
                                 args=(soak, a.seed * 1000 + 100 + i, soak.key(i)),
                                 name=f"http-{i}") for i in range(a.http_threads)]
    threads.append(threading.Thread(target=async_thread, args=(soak, a.async_tasks,
                                                               a.seed * 1000 + 200),
                                    name="async"))
    threads.append(threading.Thread(target=chaos_thread, args=(soak, a.seed * 1000 + 300),
                                    name="chaos"))
    if a.attack_every > 0 and a.attacks:
        threads.append(threading.Thread(target=attacker_thread,
                                        args=(soak, a.seed * 1000 + 400), name="attacker"))
    restarts: list[dict[str, Any]] = []
    killer = None
    if kill_every:
        killer = threading.Thread(target=killer_thread,
                                  args=(soak, control, kill_every, until, restarts),
                                  name="killer")
        threads.append(killer)
    monitor_stop = threading.Event()
    mon = threading.Thread(target=monitor.run, args=(monitor_stop,), name="monitor")
    mon.start()
    for t in threads:
        t.start()
    while time.monotonic() < until and soak.running() and any(t.is_alive() for t in threads):
        time.sleep(1.0)
        elapsed = time.monotonic() - phase.started
        if int(elapsed) % 30 == 0:
            print(f"[soak] {phase.name} {elapsed:.0f}s: {dict(phase.outcomes)}", flush=True)
    soak.stop.set()
    stuck = []
    deadline = time.monotonic() + a.call_timeout + 60
    for t in threads:
        t.join(max(1.0, deadline - time.monotonic()))
        if t.is_alive():
            stuck.append(t.name)
    phase.ended = time.monotonic()
    monitor_stop.set()
    mon.join()
    monitor.poll()
    for client in clients:
        client.close()
    if stuck:
        phase.failures.append(Failure(time.monotonic(), "soak", "stuck_client_thread",
                                      ", ".join(stuck)))
    return restarts


def settle(control: Client, timeout: float = 120.0) -> dict[str, Any]:
    """Wait until nothing runs or waits, flush the cache and return the stats after it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            s = control.stats()
            if s["running"] == 0 and s["waiting"] == 0 and control.flush_cache()["flushed"]:
                time.sleep(2.0)  # closed client connections reach the server's sockets
                return control.stats()
        except (ServerError, TimeoutError):
            pass
        time.sleep(0.5)
    return control.stats()


def summarize(soak: Soak, phase: Phase) -> dict[str, Any]:
    """Counts of a phase, failures split into those a kill explains and the rest."""
    expected, unexpected = Counter(), Counter()
    unexpected_examples = []
    for f in phase.failures:
        if f.reason in EXPECTED_IN_KILL_WINDOW and soak.in_kill_window(f.t):
            expected[f.reason] += 1
        else:
            unexpected[f.reason] += 1
            if len(unexpected_examples) < 20:
                unexpected_examples.append({"kind": f.kind, "reason": f.reason,
                                            "detail": f.detail})
    wall = max((phase.ended or time.monotonic()) - phase.started, 1e-9)
    o = phase.outcomes
    return {"wall_s": round(wall, 1), "sent": sum(phase.sent.values()),
            "sent_by_kind": dict(sorted(phase.sent.items())),
            "completed": o["completed"], "aborted": o["aborted"],
            "disconnected": o["disconnected"], "refused": o["refused"],
            "failed": o["failed"], "wrong_answers": o["wrong"],
            "greedy_checked": phase.greedy_checked,
            "failed_expected": dict(expected), "failed_unexpected": dict(unexpected),
            "unexpected_examples": unexpected_examples, "wrong_examples": phase.wrong[:20],
            "output_tokens": phase.output_tokens,
            "attacks": summarize_attacks(phase, soak.in_kill_window, EXPECTED_IN_KILL_WINDOW),
            "completed_per_min": round(o["completed"] / wall * 60, 1),
            "output_tok_s": round(phase.output_tokens / wall, 2)}


# -- main --------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="length of the soak phase")
    parser.add_argument("--max-requests", type=int, default=1_000_000,
                        help="stop sending after this many calls (warm-up included)")
    parser.add_argument("--warmup-seconds", type=float, default=90.0)
    parser.add_argument("--kill-every", type=float, default=180.0,
                        help="seconds between worker kills (0: none)")
    parser.add_argument("--max-total-tokens", type=int, default=1536,
                        help="KV pool size: small, so eviction and retraction never stop")
    parser.add_argument("--init-new-token-ratio", type=float, default=0.3,
                        help="admission's first estimate of the share of max_new_tokens a "
                        "request will use: lower than the server's 0.7, so admission overcommits "
                        "the small pool and running requests get retracted often")
    parser.add_argument("--max-prompt-chars", type=int, default=20_000)
    parser.add_argument("--rpc-threads", type=int, default=3)
    parser.add_argument("--http-threads", type=int, default=3)
    parser.add_argument("--async-tasks", type=int, default=3)
    parser.add_argument("--call-timeout", type=float, default=300.0,
                        help="seconds a call may wait for an answer (else: no_answer)")
    parser.add_argument("--attack-every", type=float, default=3.0,
                        help="mean seconds between the attacker's attacks (0: no attacker)")
    parser.add_argument("--attack-timeout", type=float, default=30.0,
                        help="seconds an attack may wait for its refusal (else: no_answer)")
    parser.add_argument("--attacks", type=lambda v: [g for g in v.split(",") if g],
                        default=list(GROUPS), help="comma-separated attack groups, of "
                        + ", ".join(GROUPS) + " (default: all)")
    parser.add_argument("--max-server-rss-mib", type=float, default=6144.0,
                        help="past this RSS (the server's processes together) the sentinel "
                        "kills the server and ends the run (an attack growing it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--name", default="soak", help="file stem of the results")
    parser.add_argument("--render", type=Path, default=None,
                        help="only redraw the markdown from this JSON result")
    args = parser.parse_args()
    if unknown := set(args.attacks) - set(GROUPS):
        parser.error(f"unknown attack groups {sorted(unknown)}; known: {', '.join(GROUPS)}")
    if args.render is not None:  # the markdown is derived from the JSON alone
        report = json.loads(args.render.read_text())
        args.render.with_suffix(".md").write_text(markdown(report))
        return

    from radixserve.model.loader import load_tokenizer, resolve_model
    from radixserve.server.runtime import Runtime

    print("[soak] measuring the machine", flush=True)
    machine = machine_info()
    machine["commit_full"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                            text=True, cwd=Path(__file__).parent).stdout.strip()
    limits = measure_limits(quick=True)
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    print("[soak] computing the greedy references with transformers", flush=True)
    t = time.monotonic()
    cases, case_info = build_cases(model_dir, tokenizer)
    case_info["reference_s"] = round(time.monotonic() - t, 1)
    print(f"[soak] {case_info}", flush=True)

    kills_planned = int(args.minutes * 60 // args.kill_every) if args.kill_every else 0
    keys = {tenant: secrets.token_urlsafe(16) for tenant in TENANTS}
    admin_key = secrets.token_urlsafe(16)
    has_admin = "admin_api_key" in {f.name for f in dataclasses.fields(ServerConfig)}
    options = dict(max_total_tokens=args.max_total_tokens, debug_invariants=True,
                   max_worker_restarts=kills_planned + 5, max_prompt_chars=args.max_prompt_chars,
                   init_new_token_ratio=args.init_new_token_ratio,
                   min_new_token_ratio=min(0.05, args.init_new_token_ratio),
                   log_level="warning")
    shown = {**options, "api_key": [f"<key>={tenant}" for tenant in keys]}
    options["api_key"] = [f"{key}={tenant}" for tenant, key in keys.items()]
    if has_admin:  # the operator key (issue 25), where this commit's server has it
        options["admin_api_key"], shown["admin_api_key"] = admin_key, "<key>"
    report: dict[str, Any] = {"settings": {**vars(args), "out": str(args.out),
                                           "server_options": shown},
                              "machine": machine, "limits": limits, "cases": case_info}
    control_key = admin_key if has_admin else keys[TENANTS[0]]
    with Runtime(str(model_dir), **options) as rt, \
            Client(rt.rpc_address, timeout=60, api_key=control_key) as control:
        info = control.model_info()
        report["server"] = {k: info[k] for k in ("num_blocks", "page_size", "max_total_tokens",
                                                  "context_length", "device", "dtype")}
        soak = Soak(args, rt, cases, {**info, "keys": keys, "control_key": control_key,
                                      "a_token": tokenizer.convert_tokens_to_ids("a")})
        root = rt.process.popen.pid
        sentinel_done = threading.Event()
        sentinel = threading.Thread(target=Sentinel(soak, root, args.max_server_rss_mib).run,
                                    args=(sentinel_done,), name="sentinel")
        sentinel.start()

        # The references agree with the server at rest (one batch of every case), or the
        # soak's check would be meaningless.
        results = control.generate(input_ids=[c.ids for c in cases],
                                   sampling_params=[c.params for c in cases])
        report["cases"]["at_rest_mismatches"] = [
            c.name for c, r in zip(cases, results) if r["output_ids"] != c.expected]
        print(f"[soak] at rest, mismatches: {report['cases']['at_rest_mismatches']}", flush=True)

        monitor = Monitor(control, root)
        print(f"[soak] warm-up {args.warmup_seconds:.0f}s", flush=True)
        warm, phase = Phase("warm-up"), Phase("soak")
        run_traffic(soak, warm, args.warmup_seconds, None, monitor, control)
        restarts: list[dict[str, Any]] = []
        start_tree = end_tree = end_stats = pids_at_end = None
        try:
            if soak.server_dead is None:
                settle(control)
                start_tree = process_tree(root, names_of(control))
                print(f"[soak] start: {start_tree}", flush=True)
        except (ServerError, TimeoutError, psutil.Error) as e:
            soak.server_dead = f"no answer after the warm-up: {e!r}"
        if soak.server_dead is None:
            print(f"[soak] soak {args.minutes:g} min, a worker kill every {args.kill_every:g}s",
                  flush=True)
            monitor.base, monitor.last = Counter(), {}
            monitor.poll()
            counters_before = monitor.totals()
            monitor.t0 = time.monotonic()
            restarts = run_traffic(soak, phase, args.minutes * 60,
                                   args.kill_every or None, monitor, control)
            after = monitor.totals()
            report["scheduler"] = {
                **{k: after[k] - counters_before.get(k, 0) for k in Monitor.COUNTERS},
                "peak_pool_usage": round(monitor.peak_pool_usage, 3),
                "peak_running": monitor.peak_running, "peak_waiting": monitor.peak_waiting}
        try:  # a server the attacks hung or killed: the report says so instead of waiting
            if soak.server_dead is None:
                end_stats = settle(control)
                end_tree = process_tree(root, names_of(control))
                print(f"[soak] end: {end_tree}", flush=True)
                pids_at_end = control.health()["pids"]
        except (ServerError, TimeoutError, psutil.Error) as e:
            soak.server_dead = f"no answer at the end: {e!r}"
        sentinel_done.set()  # before the shutdown, which it would take for a death
        sentinel.join()
        if phase.ended is None:  # not run: the server was gone after the warm-up
            phase.ended = phase.started

        report["warmup"] = summarize(soak, warm)
        report["soak"] = summarize(soak, phase)
        report["server_dead"] = soak.server_dead
        report["restarts"] = restarts
        report.setdefault("scheduler", None)
        report["end_stats"] = end_stats and {k: end_stats[k] for k in (
            "num_blocks", "free_blocks", "evictable_blocks", "locked_blocks", "running",
            "waiting", "partial_blocks")}
        report["leaked_blocks"] = end_stats and end_stats["num_blocks"] - end_stats["free_blocks"]
        report["start"], report["end"] = start_tree, end_tree
        report["samples"] = monitor.samples
    # After shutdown: no process of the server may be left.
    time.sleep(2.0)
    report["orphans"] = [p for p in (pids_at_end or {}).values() if psutil.pid_exists(p)
                         and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    report["loadavg_at_end"] = os.getloadavg()
    report["verdict"] = verdict(report)
    write(report, args.out / args.name)


def names_of(control: Client) -> dict[int, str]:
    return {pid: name for name, pid in control.health()["pids"].items()}


def growth(start: float, end: float) -> float:
    return (end - start) / start if start else 0.0


def verdict(r: dict[str, Any]) -> dict[str, Any]:
    """The pass criteria; a figure the run could not measure (the server died or hung)
    fails its check."""
    s = r["soak"]
    measured = r["start"] is not None and r["end"] is not None
    rss_growth = growth(r["start"]["rss_mib"], r["end"]["rss_mib"]) if measured else None
    fd_growth = growth(r["start"]["fds"], r["end"]["fds"]) if measured else None
    checks = {
        "the server lived through the run": not r.get("server_dead"),
        "wrong answers = 0": s["wrong_answers"] == 0 and r["warmup"]["wrong_answers"] == 0,
        "KV blocks leaked = 0": r["leaked_blocks"] == 0,
        "RSS growth < 5%": rss_growth is not None and rss_growth < 0.05,
        "open fds growth < 5%": fd_growth is not None and fd_growth < 0.05,
        "no unexpected failure": not s["failed_unexpected"],
        "attacks: 0 unexplained failures": all(
            p.get("attacks", {}).get("total", {}).get("unexplained", 0) == 0
            for p in (s, r["warmup"])),
        "every worker kill survived": all(x["served_again"] and x.get("probe_correct")
                                          for x in r["restarts"]),
        "at rest the server agrees with the reference": not r["cases"]["at_rest_mismatches"],
        "no process left after shutdown": not r["orphans"],
    }
    return {"rss_growth": rss_growth and round(rss_growth, 4),
            "fd_growth": fd_growth and round(fd_growth, 4),
            "checks": checks, "passed": all(checks.values())}


def write(r: dict[str, Any], stem: Path) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(r, indent=1, default=str))
    md = markdown(r)
    stem.with_suffix(".md").write_text(md)
    print(md)


def markdown(r: dict[str, Any]) -> str:
    s, m, v, sched = r["soak"], r["machine"], r["verdict"], r["scheduler"]
    a = r["settings"]
    lim = r["limits"]
    kills = r["restarts"]
    survived = sum(1 for k in kills if k["served_again"] and k.get("probe_correct"))
    failed_by = ", ".join(f"{k} {n}" for k, n in sorted(s["failed_expected"].items())) or "none"
    unexpected = ", ".join(f"{k} {n}" for k, n in sorted(s["failed_unexpected"].items())) or "none"
    st, en = r["start"], r["end"]
    gone = "not measured: the server is gone"
    w = r["warmup"]
    lines = [
        (f"# Soak: {s['wall_s'] / 60:.1f} minutes of mixed RPC and HTTP traffic, "
         + (f"a worker kill every {a['kill_every']:g} s" if a["kill_every"] else "no worker kill"))
        if s["wall_s"] >= 1 else "# Soak: not run (the server was gone after the warm-up)",
        "",
        f"Commit `{m['commit_full']}` ({m['commit']}), {m['cpu']}, {m['cores']} cores, "
        f"{m['memory_gib']} GiB; torch {m['torch']}, transformers {m['transformers']}, "
        f"Python {m['python']}. Measured limits before the server started: fp32 matmul "
        f"{lim['matmul_gflops']:.1f} GFLOP/s, memory read {lim['read_gbs']:.1f} GB/s. Load "
        f"average at start {m['loadavg_at_start'][0]:.2f}, at end {r['loadavg_at_end'][0]:.2f}.",
        "",
        f"Server: model `{a['model']}` ({r['server']['dtype']}, {r['server']['device']}), KV pool "
        f"{r['server']['max_total_tokens']} tokens ({r['server']['num_blocks']} blocks of "
        f"{r['server']['page_size']}), `debug_invariants=True` (the block invariant checked "
        f"after every step), `init_new_token_ratio` {a['init_new_token_ratio']:g} (the "
        "server's default is 0.7: admission here overcommits the small pool, so running "
        f"requests are retracted often), max_prompt_chars {a['max_prompt_chars']}. Clients: "
        f"{a['rpc_threads']} RPC `Client` threads, {a['async_tasks']} `AsyncClient` tasks, "
        f"{a['http_threads']} HTTP threads (`/generate` and `/v1/chat/completions`), one chaos "
        f"thread (malformed frames, vanishing raw clients); call timeout {a['call_timeout']:g} s."
        + (f" Attacker: one thread, an attack every {a['attack_every']:g} s on average "
           f"({', '.join(a['attacks'])}), each bounded by {a['attack_timeout']:g} s; tenants "
           "`alice` and `bob` (the traffic's clients take turns), the idle checks and flushes "
           "with the operator's key." if a.get("attack_every") else "")
        + (" Environment: " + ", ".join(f"`{k}={v}`" for k, v in a["environment"].items()) + "."
           if a.get("environment") else ""),
        "",
        "| figure | value |", "|---|---|",
        f"| calls sent | {s['sent']} |",
        f"| completed (answered in full; greedy ones checked) | {s['completed']} "
        f"({s['greedy_checked']} greedy answers checked) |",
        f"| aborted by the soak mid-flight (answer a prefix of the reference) | {s['aborted']} |",
        f"| disconnected by the soak on purpose (HTTP closed, stream abandoned, raw client gone) "
        f"| {s['disconnected']} |",
        f"| refused as they must be (invalid requests: 4xx / invalid_request; malformed frames: "
        f"malformed_frame or invalid_request) | {s['refused']} |",
        f"| failed, explained by a worker kill | {sum(s['failed_expected'].values())} "
        f"({failed_by}) |",
        f"| failed otherwise (must be 0) | {sum(s['failed_unexpected'].values())} ({unexpected}) |",
        f"| **wrong answers** (must be 0) | **{s['wrong_answers']}** |",
        "| **KV blocks leaked** after the final flush (must be 0) | " + (
            f"**{r['leaked_blocks']}** of {r['end_stats']['num_blocks']} |" if r["end_stats"]
            else f"{gone} |"),
        "| RSS of the server's processes, start -> end | " + (
            f"{st['rss_mib']:.0f} -> {en['rss_mib']:.0f} MiB (**{v['rss_growth']:+.1%}**) |"
            if st and en else f"{gone} |"),
        "| open file descriptors, start -> end | " + (
            f"{st['fds']} -> {en['fds']} (**{v['fd_growth']:+.1%}**) |" if st and en
            else f"{gone} |"),
        f"| worker kills survived (served again, a greedy probe right) | **{survived} of "
        f"{len(kills)}** (restart {_restart_range(kills)}) |",
        *([f"| scheduler retractions / tokens evicted from the radix cache | "
           f"{sched['retractions']} / {sched['evicted_tokens']} |",
           f"| peak pool usage, running, waiting | {sched['peak_pool_usage']:.0%}, "
           f"{sched['peak_running']}, {sched['peak_waiting']} |",
           f"| prefix cache hit rate (prompt tokens) | "
           f"{sched['prompt_cached_tokens'] / max(sched['prompt_tokens'], 1):.0%} |"]
          if sched else []),
        f"| throughput | {s['completed_per_min']:.1f} completed calls/min, "
        f"{s['output_tok_s']:.1f} output tokens/s of completed calls |",
        "",
        "Checks: " + "; ".join(f"{name}: {'yes' if ok else '**no**'}"
                               for name, ok in v["checks"].items()) + ".",
        *(["", f"**The server is gone**: {r['server_dead']}."] if r.get("server_dead") else []),
        "", f"The warm-up ({w['wall_s']:g} s): {w['sent']} calls, {w['wrong_answers']} wrong "
        "answers, failed otherwise: " + (", ".join(
            f"{k} {n}" for k, n in sorted(w["failed_unexpected"].items())) or "none") + ".",
    ]
    lines += attacks_section(r)
    if st and en:
        lines += ["", "Per process (start -> end; the scheduler and worker at the end are the "
                  "ones the last kill started, the front door, which also runs the HTTP server, "
                  "lives through the whole run):", ""]
    for name in en["processes"] if st and en else []:
        e = en["processes"][name]
        b = st["processes"].get(name)
        was = f"{b['rss_mib']:.0f} MiB, {b['fds']} fds -> " if b else ""
        change = f" ({growth(b['rss_mib'], e['rss_mib']):+.1%} RSS)" if b else ""
        lines.append(f"- {name}: {was}{e['rss_mib']:.0f} MiB, {e['fds']} fds{change}")
    worker = [(x["t_s"], x["rss_mib_each"].get("worker")) for x in r["samples"]
              if x.get("rss_mib_each", {}).get("worker") is not None]
    if worker:
        lines += ["", "Worker RSS during the soak, MiB (every 30 s; each kill starts a new "
                  "worker, and a small value is one still loading): " + ", ".join(f"{mib:.0f}" for _, mib in worker) + "."]
    lines += [
        "", "Calls by kind: " + ", ".join(f"{k} {n}" for k, n in s["sent_by_kind"].items()) + ".",
        "", "How it is measured:", "",
        f"- The start figures are taken after a {a['warmup_seconds']:g} s warm-up of the same "
        "traffic (no kill), so that allocator pools, caches and lazy imports have reached "
        "steady state; both start and end are taken idle, after a cache flush, with only the "
        "control client connected. RSS is summed over the front door, scheduler and worker "
        "(shared library pages count once per process, the same at both ends).",
        "- Greedy references: transformers, fp32, one prompt at a time, computed before the "
        f"server started; {r['cases']['cases']} chat-formatted prompts (of "
        f"{r['cases']['prompt_tokens']} tokens; several share a system prompt of some 400 "
        f"tokens), each cut before its first near-tie (top-2 logits within 1e-4): "
        f"{r['cases']['cut_at_near_tie'] or 'none was'}. So every greedy answer, whatever the "
        "batch it ran in, must equal its reference exactly (ids on RPC and /generate, text on "
        "the chat route); one aborted mid-way must be a prefix of it.",
        "- Failures `worker_died` and `not_ready` count as explained only within a kill's "
        f"window (kill -> served again + {KILL_WINDOW_GRACE_S:g} s); any other failure, and a "
        "call with no answer within the call timeout (`no_answer`), counts against the run.",
        "- Retractions and evictions are the scheduler's own counters, polled every 5 s and "
        "summed over the schedulers the kills started (so a few seconds before each kill are "
        "missing: at least these many).",
        f"- The machine has {m['cores']} cores, shared during the run with other jobs (the load "
        "average above); throughput is modest for that reason and because every step checks "
        "the block invariant. The point of this run is the correctness counts, not speed.",
    ]
    if r.get("notes"):  # written after the run, into the JSON, by whoever read it
        lines += ["", "## Notes on this run", "", *r["notes"]]
    return "\n".join(lines) + "\n"


def attacks_section(r: dict[str, Any]) -> list[str]:
    """The attacker's table (soak phase), its unexplained failures, the warm-up's total."""
    s, w = r["soak"].get("attacks"), r["warmup"].get("attacks")
    if not s or not (s["total"]["sent"] or w["total"]["sent"]):
        return []
    lines = ["", "Attacks (bench/soak_attacks/) during the soak, by kind: refused as expected "
             "(a 4xx / invalid_request / unauthorized / forbidden in time; `tenants.rid_*`: "
             "alice's stream came out whole and right), served where the issue allows it, "
             "failed in a worker kill's window, and unexplained (must be 0):", "",
             *attack_table(s)]
    wt = w["total"]
    lines += ["", f"During the warm-up: {wt['sent']} attacks, {wt['refused']} refused, "
              f"{wt['served']} served, {wt['explained']} failed in a kill's window, "
              f"**{wt['unexplained']} unexplained**."]
    examples = s["unexplained_examples"] + w["unexplained_examples"]
    if examples:
        lines += ["", "Unexplained attack failures (the first of each kind and reason):", ""]
        seen = set()
        for e in examples:
            if (e["kind"], e["reason"]) not in seen:
                seen.add((e["kind"], e["reason"]))
                lines.append(f"- {e['kind']}: {e['reason']}: {e['detail'][:200]}")
    return lines


def _restart_range(kills: list[dict[str, Any]]) -> str:
    if not kills:
        return "no kill"
    times = [k["restart_s"] for k in kills]
    return f"{min(times):.1f}-{max(times):.1f} s"


if __name__ == "__main__":
    main()
