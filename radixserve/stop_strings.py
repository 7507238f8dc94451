"""Stop strings and stop patterns: the one home of how they are found, held back while
streaming, and trimmed.

The scheduler looks for them in the decoded output (to stop generating), the streaming
detokenizer holds back a tail that could still become one, and the final text is cut at
the one found. All three decode with `stop_decoder` (the same tokenizer, loaded by
`model.loader.load_tokenizer` in every process), so they see the same text.

`stop` holds plain strings; `stop_regex` holds Python regular expressions, matched with the
`regex` module: it reads `re`'s syntax the same way and can also tell a partial match (a
tail that more text may complete), which is what a stream must hold back. Until
`min_new_tokens` are out nothing stops a request: a stop counts only if its match ends in
the text past the first `min_new_tokens - 1` tokens (the `after` arguments below).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import regex

from radixserve.messages import SamplingParams

Decode = Callable[[list[int], bool, bool], str]
"""`decode(token_ids, skip_special_tokens, spaces_between_special_tokens) -> text`."""


def stop_decoder(tokenizer: Any) -> Decode:
    """How every process turns tokens into text: the same tokenizer call (and so the same
    cleanup rules) for the text stops are matched in and the text the caller receives."""
    return lambda ids, skip, spaces: tokenizer.decode(
        ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)


@functools.lru_cache(maxsize=1024)
def compile_stop_regex(pattern: str) -> regex.Pattern:
    """A `stop_regex` pattern, compiled once per process; a ValueError naming the field for
    one that does not compile or that matches the empty string (it would stop at once)."""
    try:
        compiled = regex.compile(pattern)
    except (regex.error, RecursionError) as e:
        raise ValueError(f"sampling_params.stop_regex {pattern!r} is not a valid regular "
                         f"expression: {e}") from None
    if compiled.search("") is not None:
        raise ValueError(f"sampling_params.stop_regex {pattern!r} matches the empty string")
    return compiled


@dataclass(frozen=True)
class StopMatch:
    matched: str
    """The stop string, or the pattern, as the finish reason names it."""
    start: int
    end: int


@dataclass(frozen=True)
class Stops:
    """A request's stop strings and stop patterns."""

    strings: tuple[str, ...] = ()
    patterns: tuple[regex.Pattern, ...] = ()

    @classmethod
    def of(cls, sampling: SamplingParams) -> "Stops":
        """Raises ValueError for a bad pattern (checked at the edge, before any work)."""
        regexes = sampling.stop_regex
        regexes = [] if regexes is None else [regexes] if isinstance(regexes, str) else regexes
        return cls(tuple(sampling.stop_strings()), tuple(map(compile_stop_regex, regexes)))

    def __bool__(self) -> bool:
        return bool(self.strings or self.patterns)

    def window(self, num_output: int) -> int:
        """Where the text to search begins, as an index into the output tokens. A stop
        string the newest token completed spans at most `len(stop)` characters, and no
        token decodes to nothing but a few partial UTF-8 bytes, so that many tokens plus a
        margin suffice; a pattern may span any length, so it sees the whole output."""
        if self.patterns:
            return 0
        return max(0, num_output - max(len(s) for s in self.strings) - 4)

    def find(self, text: str, after: int = 0, only: str | None = None) -> StopMatch | None:
        """The stop whose match ends past `after` and starts first in `text` (a stop string
        before a pattern at the same place; one new token can complete several at once,
        such as "\\n " for stops [" ", "\\n"]). With `only`, just that stop."""
        found = []
        for s in self.strings:
            at = text.find(s, max(0, after - len(s) + 1)) if only in (None, s) else -1
            if at >= 0:
                found.append(StopMatch(s, at, at + len(s)))
        for p in self.patterns:
            m = _first_match(p, text, after) if only in (None, p.pattern) else None
            if m is not None:
                found.append(StopMatch(p.pattern, m.start(), m.end()))
        return min(found, key=lambda m: m.start, default=None)

    def shown(self, text: str, after: int, start: int) -> int:
        """How much of `text` a stream may show, given it showed `start` characters: all
        but a tail that is or may still become a stop's match, so that what it shows is
        never trimmed from the final text."""
        safe = len(text) - max((len(s) - 1 for s in self.strings), default=0)
        for p in self.patterns:
            # A match cannot begin in text already shown: no partial match did back then.
            m = _first_match(p, text, after, start, partial=True)
            if m is not None:
                safe = min(safe, m.start())
        return safe


def _first_match(pattern: regex.Pattern, text: str, after: int, pos: int = 0,
                 partial: bool = False) -> Any:
    """The first match of `pattern` in `text` from `pos` that ends past `after` (or, with
    `partial`, may still grow); searching from `pos` keeps the text before it as context
    for look-behinds and `\\b`."""
    m = pattern.search(text, pos, partial=partial)
    while m is not None and not m.partial and m.end() <= after:
        m = pattern.search(text, m.start() + 1, partial=partial)
    return m


def uncounted(min_new_tokens: int) -> int:
    """How many of the first output tokens no stop may end in: with `min_new_tokens`, the
    `min_new_tokens`-th token is the first that may complete one. The `after` of a text is
    the length of those tokens' text."""
    return max(min_new_tokens - 1, 0)


def trim(text: str, matched: Any, stops: Stops, after: int, keep_stop: bool) -> str:
    """`text` cut where the stop `matched` (a finish reason's stop string or pattern)
    begins, or where it ends with `keep_stop` (`no_stop_trim`): never past the stop, as in
    SGLang. Stop tokens are the caller's to drop, before decoding."""
    if not isinstance(matched, str):
        return text
    m = stops.find(text, after, only=matched)
    if m is None:
        return text
    return text[:m.end] if keep_stop else text[:m.start]
