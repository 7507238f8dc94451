"""Work bounds (issue 41, findings 1, 2, 3, 4, 6, 7): requests whose cost is a product of
factors each within its bound: outputs x prompt positions x top logprobs, stop patterns x
output, a huge JSON schema over HTTP, a full-vocabulary `logit_bias`, a chat of thousands
of tool results, a deeply nested schema.
Each must be refused by name, or served (or ended by its own budget) without another
tenant noticing; the soak's victims and sentinel judge the rest."""

from __future__ import annotations

from typing import Any

from tools.soak.attacks.base import Attacker, http_outcome, rpc_outcome
from tools.soak.outcome import Outcome, served


def _either(a: Attacker, kind: str, params: dict[str, Any], prompt: str = "Say a")\
        -> list[tuple[str, Outcome]]:
    """`params` over RPC or HTTP /generate, as a random tenant: refused or served."""
    t = a.tenant()
    if a.rng.random() < 0.5:
        return [(f"{kind}.rpc", rpc_outcome(
            lambda: a.rpc[t].generate(prompt, params, timeout=a.timeout),
            serve=lambda r: served()))]
    return [(f"{kind}.generate", http_outcome(a.http[t].post(
        "/generate", json={"text": prompt, "sampling_params": params}),
        serve=lambda r: served()))]


def logprob_product(a: Attacker) -> list[tuple[str, Outcome]]:
    """n=128 outputs x a 1,500-token prompt's logprobs x top 100: refused by
    `max_logprob_entries` before any work (each factor is within its own bound)."""
    t = a.tenant()
    return [("bounds.logprob_product.rpc", rpc_outcome(lambda: a.rpc[t].generate(
        "word " * 1500, {"n": 128, "max_new_tokens": 1}, return_logprob=True,
        logprob_start_len=0, top_logprobs_num=100, timeout=a.timeout)))]


def stop_pattern_product(a: Attacker) -> list[tuple[str, Outcome]]:
    """n=4 outputs x 64 case-insensitive patterns (no partial matches): ended by the
    output's search budget (an abort naming it) or served, never a slowdown for others."""
    return _either(a, "bounds.stop_patterns", {
        "n": 4, "max_new_tokens": 256, "ignore_eos": True,
        "stop_regex": [f"(?i)never{i} here" for i in range(64)]})


def full_vocab_logit_bias(a: Attacker) -> list[tuple[str, Outcome]]:
    """A `logit_bias` over 49,152 tokens: refused (at most 300 entries)."""
    return _either(a, "bounds.logit_bias", {
        "n": 8, "max_new_tokens": 8, "logit_bias": {str(i): 0.5 for i in range(49_152)}})


def deep_schema(a: Attacker) -> list[tuple[str, Outcome]]:
    """Arrays nested 960 deep (47 s to compile once): refused by its depth at the edge."""
    # written out: json.dumps stops at Python's recursion limit (two levels a nesting)
    schema = '{"type": "array", "items": ' * 960 + '{"type": "integer"}' + "}" * 960
    return _either(a, "bounds.deep_schema", {"max_new_tokens": 8,
                                             "json_schema": schema})


def huge_chat_schema(a: Attacker) -> list[tuple[str, Outcome]]:
    """An 8 MB `response_format` schema: refused by its size before the metaschema walk,
    which runs off the HTTP loop (so /health answers meanwhile)."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"}
                                                for i in range(300_000)}}
    body = {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}}}
    return [("bounds.huge_schema.chat", http_outcome(
        a.http[a.tenant()].post("/v1/chat/completions", json=body)))]


def tool_results_chat(a: Attacker) -> list[tuple[str, Outcome]]:
    """4,000 tool results in one chat: rendered in linear time (served) or refused."""
    messages = [{"role": "user", "content": "go"}]
    messages += [{"role": "tool", "tool_call_id": f"c{i}", "content": "r" * 200}
                 for i in range(4000)]
    body = {"model": "default", "max_tokens": 4, "messages": messages}
    return [("bounds.tool_results.chat", http_outcome(
        a.http[a.tenant()].post("/v1/chat/completions", json=body),
        serve=lambda r: served()))]


ATTACKS = [("bounds", logprob_product, 1), ("bounds", stop_pattern_product, 1),
           ("bounds", full_vocab_logit_bias, 1),
           ("bounds", deep_schema, 1), ("bounds", huge_chat_schema, 0.5),
           ("bounds", tool_results_chat, 0.5)]
"""(group, attack, weight) for the attacker's catalogue."""
