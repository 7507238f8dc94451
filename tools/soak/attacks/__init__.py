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
for the rest of the traffic (tools/soak/).

The groups (`--attacks`): counts (huge n, best_of, top_logprobs, batches), nesting (deep
msgpack over a raw DEALER, deep JSON over HTTP), template (a caller's Jinja template; a
template variable), regex (a backtracking `stop_regex` over a forced run of `a`s; bursts of
slow JSON-schema grammars), tenants (bob aborting or reusing alice's rid, bob calling the
operator's calls, pinning past a quota, subscribing to the cache events without a key),
small (GET on /flush_cache and /start_profile, calls with no key or a wrong one),
front_door (issue 53: a large RPC call or an HTTP body without a known key, a burst of
slow connections), loops (issue 53: costly or oversized stop patterns, an ambiguous grammar,
one wide long request).

Modules: base (judging an answer, the attacker's identities and loop; the outcomes
themselves are tools/soak/outcome.py), payloads (classes 1-4 of the
issue), tenants (classes 5-8), shares (issue 41: a queue flood past a tenant's share, the
operator's abort_all), work_bounds (issue 41), front_door (issue 53, items 4 and 5), loops
(issue 53, items 1 and 3); here the catalogue, the sentinel and the report's table.
"""

from __future__ import annotations

import signal
import threading
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable

import psutil

from tools.soak.attacks import front_door, loops, payloads, shares, tenants, work_bounds
from tools.soak.attacks.base import GROUPS, TENANTS, Attack, Attacker
from tools.soak.outcome import Outcome

if TYPE_CHECKING:
    from tools.soak.state import Soak

__all__ = ["GROUPS", "TENANTS", "Outcome", "Sentinel", "attack_table", "attacker_thread",
           "summarize_attacks"]

CATALOGUE: list[tuple[str, Attack, float]] = [
    ("counts", payloads.huge_count, 3), ("counts", payloads.huge_batch, 1),
    ("nesting", payloads.deep_rpc, 1.5), ("nesting", payloads.deep_http, 1.5),
    ("template", payloads.template, 2), ("regex", payloads.stop_regex, 1.5),
    ("regex", payloads.grammar_burst, 0.5), ("tenants", tenants.rid_crossing, 2),
    ("tenants", tenants.operator_call, 3), ("tenants", tenants.pin_quota, 0.5),
    ("tenants", tenants.events_without_key, 1), ("small", tenants.small, 2),
    ("shares", shares.queue_flood, 0.5), ("shares", shares.operator_abort, 1),
    *work_bounds.ATTACKS, *front_door.ATTACKS, *loops.ATTACKS]
"""(group, attack, weight): how often each is picked among the groups `--attacks` names."""


def attacker_thread(soak: Soak, seed: int) -> None:
    attacker = Attacker(soak, seed)
    try:
        attacker.run([(fn, weight) for group, fn, weight in CATALOGUE
                      if group in soak.args.attacks])
    finally:
        attacker.close()


# -- the sentinel -------------------------------------------------------------------------------
class Sentinel:
    """Watches the server's process tree: if the front door exits, or the tree's RSS passes
    `max_rss_mib` (an attack growing it until the kernel would kill something, on a shared
    machine), it notes why (and the attack in flight), kills the tree in the second case,
    and stops the soak: the run then ends and reports instead of waiting on a dead server."""

    def __init__(self, soak: Soak, root_pid: int, max_rss_mib: float) -> None:
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
        note = f" ({reasons})" if reasons else ""
        lines.append(f"| {kind} | {r['sent']} | {r['refused']} | {r['served']} | "
                     f"{r['explained']} | {r['unexplained']}{note} |")
    t = a["total"]
    lines.append(f"| **all** | {t['sent']} | {t['refused']} | {t['served']} | {t['explained']} "
                 f"| **{t['unexplained']}** |")
    return lines
