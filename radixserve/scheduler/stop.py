"""When a request is done generating."""

from __future__ import annotations

import time
from typing import Any, Collection

from radixserve.scheduler.request import Req
from radixserve.stop_strings import SEARCH_SECONDS, Decode, PartialTimeout, uncounted

SETTLE_TOKENS = 4
"""Tokens at the end of the output whose text may still change (a character split across
tokens, spacing that depends on the next token): a search always re-reads them."""


def check_finish(req: Req, eos_ids: Collection[int],
                 decode: Decode | None) -> dict[str, Any] | None:
    """The finish reason after `req`'s newest token, or None to go on.

    Order as in SGLang: length, then stop token ids, then EOS, then stop strings and
    patterns; last, a constrained request whose output is complete (or broken). Until
    `min_new_tokens` are out no stop counts (the sampler keeps EOS and stop tokens out
    meanwhile); length and the constraint still end a request. Stops are looked for in the
    decoded output (see stop_strings.py).
    """
    sp = req.sampling
    out = req.output_ids
    if len(out) >= sp.max_new_tokens:
        return {"type": "length", "length": sp.max_new_tokens}
    if len(out) >= sp.min_new_tokens:
        token = out[-1]
        if sp.stop_token_ids and token in sp.stop_token_ids:
            return {"type": "stop", "matched": token}
        if not sp.ignore_eos and token in eos_ids:
            return {"type": "stop", "matched": token}
        if req.stops and decode is not None:
            began = time.perf_counter()
            found = _find_stop(req, decode)
            if found is not None:
                return {"type": "stop", "matched": found}
            if req.stops.patterns:
                req.stop_budget.search_left -= time.perf_counter() - began
                if req.stop_budget.search_left <= 0:
                    return {"type": "abort", "message": "the stop_regex searches ran past "
                            f"their budget of {SEARCH_SECONDS:g}s per output: use fewer or "
                            "simpler patterns (or stop strings)"}
    if req.grammar is not None:
        if req.grammar.broken:
            return {"type": "abort", "message": "the sampled token breaks the output's "
                    f"constraint (sampling_params.{req.grammar.grammar.kind})"}
        if req.grammar.complete:  # the output cannot grow: done, nothing to trim
            return {"type": "stop", "matched": None}
    return None


def _find_stop(req: Req, decode: Decode) -> str | None:
    """The stop the newest token completed, if any, searched for only in the text the new
    tokens can change: stop strings in the last few tokens' text (`Stops.window`),
    patterns from `req.stop_from`, where a match may still begin, with one token before it
    as context for `^` and `\\b`. Linear in that text (RE2)."""
    # Special tokens stay in the text searched (as SGLang does), so a stop string such as
    # "<|im_start|>" stops generation whatever `skip_special_tokens` hides.
    out, stops = req.output_ids, req.stops
    begin = max(0, req.stop_from - 1) if stops.patterns else len(out)
    start = min(stops.window(len(out)), begin)
    text = decode(out[start:], False, True)
    pos = len(decode(out[start:req.stop_from], False, True)) if req.stop_from > start else 0
    old = uncounted(req.sampling.min_new_tokens)
    after = len(decode(out[start:old], False, True)) if old > start else 0
    found = stops.find(text, after, pos=pos)
    if found is not None:
        return found.matched
    if stops.patterns and req.stop_budget.left > 0:
        try:
            if stops.resume_at(text, pos, after, req.stop_budget) == len(text):
                req.stop_from = max(req.stop_from, len(out) - SETTLE_TOKENS)  # none under way
        except PartialTimeout:
            pass  # the budget is spent: searched from stop_from on, as it stands
    return None
