"""The attacks on the tenants' shares (issue 41, findings 5 and 11): bob floods the queue
past his share while alice's greedy case streams; bob tries to abort alice's requests with
`abort_all` naming her; the operator aborts all of bob's requests, and alice's stream must
still come in full and right."""

from __future__ import annotations

import threading

from tools.soak.attacks.base import Attacker, http_outcome, rpc_outcome
from tools.soak.attacks.tenants import victim_http, victim_rpc
from tools.soak.outcome import Outcome, failed, refused, served
from radixserve.client import ServerError

FLOOD_CALLS, FLOOD_PROMPTS = 3, 400
"""Bob's flood: this many calls at once of this many one-token prompts, past the default
`--max-queued-requests-per-tenant` (1024) together."""


def queue_flood(a: Attacker) -> list[tuple[str, Outcome]]:
    """bob's calls past his queue share: each is served or refused `overloaded` naming
    `max_queued_requests_per_tenant`; alice's stream meanwhile comes in full and right."""
    bob: list[Outcome] = []

    def one(i: int) -> None:
        try:
            a.rpc["bob"].generate(prompt=[f"flood {i} {j}" for j in range(FLOOD_PROMPTS)],
                                  sampling_params={"max_new_tokens": 1})
            bob.append(served())
        except ServerError as e:
            bob.append(refused(e.code) if e.code == "overloaded"
                       and "max_queued_requests_per_tenant" in e.message
                       else failed(e.code, e.message))
        except TimeoutError as e:
            bob.append(failed("no_answer", str(e)))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(FLOOD_CALLS)]

    def attack() -> None:
        for t in threads:
            t.start()

    victim = victim_http if a.rng.random() < 0.5 else victim_rpc
    outcome = victim(a, a.soak.case(a.rng), f"soak-flooded-{a.rng.getrandbits(64):x}", attack)
    for t in threads:
        t.join(a.timeout)
    return [("shares.queue_flood.bob", o) for o in bob] + [("shares.queue_flood", outcome)]


def operator_abort(a: Attacker) -> list[tuple[str, Outcome]]:
    """bob's `abort_all` naming alice is refused; the operator's naming bob is served (RPC
    or HTTP) and alice's stream, running meanwhile, is not aborted."""
    results: list[tuple[str, Outcome]] = [("shares.abort_all_of_alice_by_bob", rpc_outcome(
        lambda: a.rpc["bob"].abort_all(tenant="alice")))]

    def attack() -> None:
        if a.rng.random() < 0.5:
            results.append(("shares.operator_abort_bob.rpc", rpc_outcome(
                lambda: a.rpc_operator.abort_all(tenant="bob"), serve=lambda r: served())))
        else:
            r = a.http_operator.post("/abort_request", json={"abort_all": True,
                                                             "tenant": "bob"})
            results.append(("shares.operator_abort_bob.http",
                            http_outcome(r, serve=lambda r: served())))

    victim = victim_http if a.rng.random() < 0.5 else victim_rpc
    outcome = victim(a, a.soak.case(a.rng), f"soak-spared-{a.rng.getrandbits(64):x}", attack)
    return [*results, ("shares.operator_abort_bob", outcome)]
