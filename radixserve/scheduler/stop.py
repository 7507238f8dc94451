"""When a request is done generating."""

from __future__ import annotations

from typing import Any, Callable, Collection

from radixserve.scheduler.request import Req

Decode = Callable[[list[int]], str]


def check_finish(req: Req, eos_ids: Collection[int], decode: Decode | None) -> dict[str, Any] | None:
    """The finish reason after `req`'s newest token, or None to go on.

    Order as in SGLang: length, then stop token ids, then EOS, then stop strings; last, a
    regex-constrained request whose match is complete (or broken). Stop strings are looked
    for in the decoded tail of the output only: the newest token can complete a match of
    at most `len(stop)` characters, and no token decodes to nothing but a few partial UTF-8
    bytes, so a window of that many tokens plus a margin suffices.
    """
    sp = req.sampling
    out = req.output_ids
    if len(out) >= sp.max_new_tokens:
        return {"type": "length", "length": sp.max_new_tokens}
    token = out[-1]
    if sp.stop_token_ids and token in sp.stop_token_ids:
        return {"type": "stop", "matched": token}
    if not sp.ignore_eos and token in eos_ids:
        return {"type": "stop", "matched": token}
    stops = sp.stop_strings()
    if stops and decode is not None:
        window = max(len(s) for s in stops) + 4
        tail = decode(out[-window:])
        # The newest token may complete several stop strings at once (a whitespace token
        # "\n " for stops [" ", "\n"]): report the one that occurs first, since the text
        # is trimmed at the reported string's first occurrence.
        found = [(tail.find(s), i) for i, s in enumerate(stops) if s in tail]
        if found:
            return {"type": "stop", "matched": stops[min(found)[1]]}
    if req.regex is not None:
        if req.regex.broken:
            return {"type": "abort", "message": "the sampled token breaks the regex match"}
        if req.regex.complete:  # the match cannot grow: done, nothing to trim
            return {"type": "stop", "matched": None}
    return None
