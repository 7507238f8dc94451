"""The loops others share (issue 53, findings 1, 2, 3, 4a, 4b, 8): work one request makes the
scheduler's loop do, and what it holds that others need. Each is refused by name, or
served or ended by its own budget (an abort naming it); the soak's victims and sentinel
judge whether anyone else noticed.

- costly stop patterns (programs of thousands of instructions, a partial match kept open):
  each search is priced before it runs and bounded per step;
- a short stop pattern over RE2's memory bound: refused, naming the bound;
- an ambiguous grammar, whose every token costs the matcher more: ended by its credit;
- one wide, long request whose expected growth is many times the pool: served beside the
  others (its expectation counts only up to its tenant's share);
- one call of hundreds of long prompts, the last over the context: refused before any is
  tokenized on the front door's loop (`max_call_chars`), or by the context's bound;
- a flood of long fresh prompts: served, each step's prefill of it capped while another
  tenant decodes or waits (`--tenant-prefill-tokens`)."""

from __future__ import annotations

from typing import Any

from tools.soak.attacks.base import Attacker, http_outcome, rpc_outcome
from tools.soak.outcome import Outcome, failed, served

HEAVY_STOPS = [r"(?:\w{1,100}\s{1,9}){1,9}(?:\d{1,100}x){1,9}", r"(?:[a-z]{1,60} ){1,15}QED"]
OVERSIZED_STOP = r"(?:[^a]{1,200}b){1,5}(?:[^c]{1,200}d){1,5}(?:[^e]{1,200}f){1,5}"
AMBIGUOUS = 'root ::= s\ns ::= s s | s "," s | "x" | "y" | "xy"'


def _ended(results: Any, bound: str) -> Outcome:
    """Served: every output finished, or was aborted naming `bound` (its budget)."""
    outs = results if isinstance(results, list) else [results]
    for out in outs:
        finish = out["meta_info"]["finish_reason"] or {}
        if finish.get("type") == "abort" and bound not in finish.get("message", ""):
            return failed("wrong_abort", str(finish)[:200])
    return served()


def _either(a: Attacker, kind: str, params: dict[str, Any], bound: str) \
        -> list[tuple[str, Outcome]]:
    t = a.tenant()
    if a.rng.random() < 0.5:
        return [(f"{kind}.rpc", rpc_outcome(
            lambda: a.rpc[t].generate("Say a", params, timeout=a.timeout),
            serve=lambda r: _ended(r, bound)))]
    return [(f"{kind}.generate", http_outcome(a.http[t].post(
        "/generate", json={"text": "Say a", "sampling_params": params}),
        serve=lambda r: _ended(r.json(), bound)))]


def costly_stops(a: Attacker) -> list[tuple[str, Outcome]]:
    return _either(a, "loops.costly_stops", {
        "n": 8, "min_new_tokens": 40, "max_new_tokens": 120, "ignore_eos": True,
        "stop_regex": HEAVY_STOPS * 8}, "budget")


def oversized_stop(a: Attacker) -> list[tuple[str, Outcome]]:
    t = a.tenant()
    return [("loops.oversized_stop.rpc", rpc_outcome(lambda: a.rpc[t].generate(
        "Hi", {"max_new_tokens": 4, "stop_regex": [OVERSIZED_STOP]}, timeout=a.timeout)))]


def ambiguous_grammar(a: Attacker) -> list[tuple[str, Outcome]]:
    return _either(a, "loops.ambiguous_grammar", {
        "n": 4, "max_new_tokens": 200, "ignore_eos": True, "ebnf": AMBIGUOUS}, "budget")


def wide_request(a: Attacker) -> list[tuple[str, Outcome]]:
    return _either(a, "loops.wide_request", {
        "n": 16, "max_new_tokens": 400, "ignore_eos": True, "temperature": 1.0}, "budget")


def big_call(a: Attacker) -> list[tuple[str, Outcome]]:
    t, words = a.tenant(), a.rng.choice(["lorem ipsum ", "a b c d ", "token soup "])
    prompts = [words * a.rng.randint(600, 1200) for _ in range(300)] + ["x " * 40_000]
    return [("loops.big_call.rpc", rpc_outcome(lambda: a.rpc[t].generate(
        prompts, {"max_new_tokens": 1}, timeout=a.timeout)))]


def prefill_flood(a: Attacker) -> list[tuple[str, Outcome]]:
    t, n = a.tenant(), a.rng.choice([700, 1200])
    ids = [[a.rng.randrange(300, 20_000) for _ in range(n)] for _ in range(2)]
    return [("loops.prefill_flood.rpc", rpc_outcome(lambda: a.rpc[t].generate(
        input_ids=ids, sampling_params={"max_new_tokens": 1}, timeout=a.timeout),
        serve=lambda r: served()))]


ATTACKS = [("loops", costly_stops, 1), ("loops", oversized_stop, 1),
           ("loops", ambiguous_grammar, 0.5), ("loops", wide_request, 0.5),
           ("loops", big_call, 0.5), ("loops", prefill_flood, 0.5)]
"""(group, attack, weight) for the attacker's catalogue."""
