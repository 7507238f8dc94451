"""When a request is done generating."""

from __future__ import annotations

from typing import Any, Collection

from radixserve.scheduler.request import Req
from radixserve.stop_strings import Decode, uncounted


def check_finish(req: Req, eos_ids: Collection[int], decode: Decode | None) -> dict[str, Any] | None:
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
            found = _find_stop(req, decode)
            if found is not None:
                return {"type": "stop", "matched": found}
    if req.grammar is not None:
        if req.grammar.broken:
            return {"type": "abort", "message": "the sampled token breaks the output's "
                    f"constraint (sampling_params.{req.grammar.grammar.kind})"}
        if req.grammar.complete:  # the output cannot grow: done, nothing to trim
            return {"type": "stop", "matched": None}
    return None


def _find_stop(req: Req, decode: Decode) -> str | None:
    # Special tokens stay in the text searched (as SGLang does), so a stop string such as
    # "<|im_start|>" stops generation whatever `skip_special_tokens` hides.
    out = req.output_ids
    start = req.stops.window(len(out))
    old = uncounted(req.sampling.min_new_tokens)
    after = len(decode(out[start:old], False, True)) if old > start else 0
    found = req.stops.find(decode(out[start:], False, True), after)
    return None if found is None else found.matched
