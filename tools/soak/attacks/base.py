"""What every attack shares: how an answer is judged against its expected outcome
(`http_outcome`, `rpc_outcome`; `Outcome` is tools/soak/outcome.py), and the attacker's
identities and sockets (`Attacker`): alice's and bob's keys, no key, the operator's, over
RPC and HTTP."""

from __future__ import annotations

import dataclasses
import random
import shutil
import tempfile
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable

import httpx
import zmq

from tools.soak.outcome import Outcome, failed, refused
from radixserve.client import Client, ServerError
from radixserve.config import ServerConfig

if TYPE_CHECKING:
    from tools.soak.state import Soak

TENANTS = ("alice", "bob")
"""The soak's tenants (`--api-key KEY=alice --api-key KEY=bob`): bob attacks alice."""
GROUPS = ("counts", "nesting", "template", "regex", "tenants", "small", "shares", "bounds",
          "front_door", "loops")
HUGE = 1_000_000_000
REFUSAL_CODES = frozenset({"invalid_request", "unauthorized", "forbidden", "malformed_frame",
                           "frame_too_large"})
"""RPC error codes that refuse a caller's request; over HTTP, any 4xx with an error body."""
OPERATOR_REFUSALS = frozenset({"unauthorized", "forbidden"})
"""What an operator-only call made with a tenant's key must get: a 400 for flush (`requests
are still running`) means the tenant was allowed to try."""


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


class Attacker:
    """The identities and sockets the attacks use (each attack is a function of it that
    returns [(kind, outcome)]), and the checks between attacks: `run` picks them, records
    them in the soak's phase and checks after each that the server's processes are those
    it had (or a scheduled kill's)."""

    def __init__(self, soak: Soak, seed: int) -> None:
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
        self.pids: dict[str, int] | None = None
        self.pids_at = time.monotonic()

    # -- the loop ---------------------------------------------------------------------------
    def run(self, attacks: list[tuple[Attack, float]]) -> None:
        soak, rng = self.soak, self.rng
        fns, weights = zip(*attacks)
        self.check_processes("start")
        while soak.running() and not soak.stop.wait(rng.uniform(0.5, 1.5) * soak.args.attack_every):
            fn = rng.choices(fns, weights)[0]
            soak.begin()
            soak.attack_in_flight = fn.__name__
            try:
                results = fn(self)
            except Exception as e:  # the soak's own bug: counted and shown, never hidden
                with soak.lock:
                    soak.client_errors += 1
                    show = soak.client_errors <= 5
                if show:
                    traceback.print_exception(e)
                results = [(fn.__name__, failed(f"client_exception:{type(e).__name__}",
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
        if self.soak.server_dead is None:  # pins must not outlive the attacker: they hold blocks
            self.unpin_all()
        for c in [*self.rpc.values(), self.rpc_nokey, self.rpc_operator]:
            c.close()
        for h in [*self.http.values(), self.http_nokey, self.http_operator]:
            h.close()
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.outside, ignore_errors=True)

    def tenant(self) -> str:
        return self.rng.choice(sorted(self.keys))

    def stop_profile(self) -> None:
        """Stop a profile an attack started (else the worker profiles every step)."""
        try:
            self.rpc_operator.stop_profile()
        except (ServerError, TimeoutError):
            pass

    def unpin_all(self) -> None:
        for client in self.rpc.values():
            try:
                client.unpin_all()
            except (ServerError, TimeoutError):
                pass  # restarting: a new scheduler has no pins


Attack = Callable[[Attacker], list[tuple[str, Outcome]]]
