"""Stop strings: the one home of how they are found, held back while streaming, and trimmed.

The scheduler looks for them in the decoded tail of each output (to stop generating), the
streaming detokenizer holds back a tail that could still become one, and the final text is
cut at the one found. All three decode with `stop_decoder` (the same tokenizer, loaded by
`model.loader.load_tokenizer` in every process), so they see the same text.
"""

from __future__ import annotations

from typing import Any, Callable

Decode = Callable[[list[int], bool], str]
"""`decode(token_ids, skip_special_tokens) -> text`."""


def stop_decoder(tokenizer: Any) -> Decode:
    """How every process turns tokens into the text stop strings are matched in: the same
    tokenizer call (and so the same cleanup rules) as the text the caller receives."""
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


def find_stop(text: str, stops: list[str]) -> str | None:
    """The stop string that occurs first in `text` (the text is cut at it), if any. One new
    token can complete several at once (a token "\\n " for stops [" ", "\\n"])."""
    found = [(text.find(s), i) for i, s in enumerate(stops) if s in text]
    return stops[min(found)[1]] if found else None


def tail_tokens(stops: list[str]) -> int:
    """How many of the newest tokens to decode to see a stop string the newest token may
    have completed: it spans at most `len(stop)` characters, and no token decodes to
    nothing but a few partial UTF-8 bytes, so that many tokens plus a margin suffice."""
    return max(len(s) for s in stops) + 4


def holdback(stops: list[str]) -> int:
    """Characters a stream keeps back: the longest proper prefix of a stop string."""
    return max((len(s) for s in stops), default=1) - 1


def trim(text: str, matched: Any) -> str:
    """`text` cut at the first occurrence of the stop string `matched` (if it is one)."""
    if isinstance(matched, str):
        cut = text.find(matched)
        if cut >= 0:
            return text[:cut]
    return text
