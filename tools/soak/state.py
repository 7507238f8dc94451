"""The soak's shared state: what a phase sent and got back (`Phase`, `Failure`) and `Soak`,
which the traffic threads record into, with the kill windows that explain a failure."""

from __future__ import annotations

import argparse
import random
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tools.soak.cases import Case
from tools.soak.outcome import Outcome

EXPECTED_IN_KILL_WINDOW = {"worker_died", "not_ready"}
"""Failure reasons a worker kill causes: calls in flight die, calls during the restart
are refused."""
KILL_WINDOW_GRACE_S = 3.0
"""A failure this long after the restarted server answered still counts as the kill's
(replies in transit, an HTTP stream's error event)."""
BACKOFF_S = 0.5
"""After a kill's failure (or an HTTP connection that failed), each client waits this long
before its next call, as a real client would: a server that is restarting (or gone) refuses
at once, and clients that retry in a tight loop would only measure how fast it says so."""


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
    """The attacker's (tools/soak/attacks/): (when, kind, what it got)."""
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
