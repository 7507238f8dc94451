"""Stop strings and stop patterns: the one home of how they are found, held back while
streaming, and trimmed.

The scheduler looks for them in the decoded output (to stop generating), the streaming
detokenizer holds back a tail that could still become one, and the final text is cut at
the one found. All three decode as `Decode` says (the same tokenizer, loaded by
`model.loader.load_tokenizer` in every process, called alike), so they see the same text.

`stop` holds plain strings; `stop_regex` holds regular expressions in RE2's syntax (Python's
`re` syntax without backreferences, lookarounds, possessive or atomic groups; `\\d`, `\\w`,
`\\s` and `\\b` are ASCII; `$` is the end of the text only). RE2 matches in time linear in
the text whatever the pattern, so a caller's pattern cannot stall the loop every request
shares (`(a|aa)+b` over a run of `a`s backtracks exponentially in `re`); a pattern RE2
cannot compile is refused at the edge. Until `min_new_tokens` are out nothing stops a
request: a stop counts only if its match ends in the text past the first
`min_new_tokens - 1` tokens (the `after` arguments below).

What a caller's patterns may cost the scheduler is bounded before it is spent. A pattern
compiles within `STOP_REGEX_MAX_MEM` (RE2's own bound, which also bounds its program and so
the compile's time and memory), and every search is paid for in advance in work units,
the pattern's program size times the characters searched (RE2's worst case, the NFA, is
linear in both; measured at 4-12 ns a unit on a 2-core EPYC, the fast DFA at under
0.3 ns): at most `SEARCH_STEP_UNITS` a request per step, shared by its samples
(`SearchBudget`). A search that would cost more is not run: the output ends with an abort
naming the bound, and no step waits on it. Over many steps an output's searches may take
`SEARCH_SECONDS` of the loop in all, measured.

Where a match may still begin (a tail that more text may complete: what a stream holds
back, and where the scheduler's next search starts) is a partial match, which RE2 cannot
tell: the `regex` module finds it, in ASCII mode as RE2 reads classes, within a budget
of `PARTIAL_SECONDS` per request and process, all searches together (`PartialBudget`).
Past that (a pattern that backtracks) the answer is "anywhere from here": a stream holds
back the rest of its text until the request ends, and the scheduler keeps searching from
where it was. Both are always right, only slower to show text.
"""

from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass
from typing import Any, Protocol

import re2
import regex

from radixserve.messages import SamplingParams

class Decode(Protocol):
    """How every process turns tokens into text: the tokenizer's own `decode`, always given
    both cleanup flags by name, so that the text stops are matched in and the text the
    caller receives come from the same call (and so the same cleanup rules)."""

    def __call__(self, token_ids: list[int], *, skip_special_tokens: bool,
                 spaces_between_special_tokens: bool) -> str: ...


PARTIAL_SECONDS = 0.05
"""The time one request's partial-match searches may take in one process, all together,
before the answer is "anywhere from here" (the `regex` module checks the clock now and
then, so a search may run a little over)."""

_FOLDS_CASE = re.compile(r"\(\?[imsU-]*i[imsU-]*[:)]")
"""A case-insensitive flag: RE2 folds case the Unicode way, the `regex` module in ASCII mode
the ASCII way, so such a pattern's partial matches are not looked for (held back whole)."""


class PartialTimeout(Exception):
    """Partial-match searches ran past their budget: a match may begin anywhere after the
    position searched from."""


STOP_REGEX_MAX_MEM = 256 << 10
"""RE2's memory bound for one stop pattern (its `max_mem`; RE2's default is 8 MiB): a
pattern whose program does not fit is refused. Real stop patterns use a few KiB; a
kilobyte of nested counted repeats does not fit, and is refused in about a millisecond."""

SEARCH_STEP_UNITS = 1_000_000
"""The work units (program size x characters) one request's stop-pattern searches may
cost in one scheduler step, its samples' together: at most ~12 ms in RE2's worst case."""

SEARCH_SECONDS = 1.0
"""The time one output's stop searches may take in the scheduler, all steps together
(decoding its text and every pattern's search): past it the output ends with an abort
naming the bound. Measured, not priced: RE2's fast DFA runs most searches far under their
worst case, and a long output's searches add up."""


class SearchOverBudget(Exception):
    """A stop-pattern search would cost more than its step allows (`SearchBudget`): the
    message names the bound, as the output's abort does."""


class PartialBudget:
    """What is left of one output's time for partial-match searches (`PARTIAL_SECONDS`)."""

    def __init__(self, seconds: float = PARTIAL_SECONDS) -> None:
        self.left = seconds


class SearchBudget(PartialBudget):
    """One output's budgets in the scheduler: its partial-match time, the time its stop
    searches may take in all (`search_left`, `SEARCH_SECONDS`), and the work units its RE2
    searches may cost in one check of a new token (`step_units_left`, refilled by
    `new_step`; a step checks each new token of an output, a few with speculation)."""

    def __init__(self, samples: int = 1, seconds: float = PARTIAL_SECONDS,
                 search_seconds: float = SEARCH_SECONDS,
                 step_units: int = SEARCH_STEP_UNITS) -> None:
        super().__init__(seconds)
        self.search_left = search_seconds
        self.step_share = step_units // max(samples, 1)
        """This output's part of its request's per-step units (its samples share them)."""
        self.step_units_left = self.step_share

    def new_step(self) -> None:
        self.step_units_left = self.step_share

    def spend(self, units: int, pattern: str) -> None:
        """Pay for a search before it runs; SearchOverBudget (and nothing paid) when it
        would cost more than is left of the step's share."""
        if units > self.step_units_left:
            raise SearchOverBudget(
                f"a stop_regex search would cost {units:,} work units (the pattern's RE2 "
                f"program size x the characters searched), over this output's step budget "
                f"of {self.step_share:,} ({SEARCH_STEP_UNITS:,} a request, shared by its "
                f"samples): use fewer or simpler patterns (or stop strings); pattern "
                f"{pattern[:80]!r}")
        self.step_units_left -= units


@dataclass(frozen=True)
class StopPattern:
    """A compiled `stop_regex`: RE2 for matches, the `regex` module for partial ones."""

    pattern: str
    engine: Any
    partial: regex.Pattern | None
    """None: partial matches are not looked for (the `regex` module reads the pattern
    differently from RE2, or not at all)."""
    cost: int = 1
    """Work units a character searched costs: RE2's forward and reverse program sizes."""


@functools.lru_cache(maxsize=256)
def compile_stop_regex(pattern: str) -> StopPattern:
    """A `stop_regex` pattern, compiled once per process; a ValueError naming the field for
    one RE2 does not compile (or whose program is over `STOP_REGEX_MAX_MEM`) or that
    matches the empty string (it would stop at once)."""
    options = re2.Options()
    options.log_errors = False
    options.max_mem = STOP_REGEX_MAX_MEM
    try:
        compiled = re2.compile(pattern, options)
    except (re2.error, UnicodeError) as e:  # a lone surrogate has no UTF-8 for RE2
        why = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) \
            else str(e)
        if "too large" in why:
            raise ValueError(f"sampling_params.stop_regex {pattern[:80]!r}... is too large: "
                             f"its RE2 program does not fit in {STOP_REGEX_MAX_MEM >> 10} "
                             "KiB (stop patterns are bounded so that searching them stays "
                             "cheap): use a simpler pattern") from None
        raise ValueError(f"sampling_params.stop_regex {pattern!r} is not a valid regular "
                         f"expression in RE2's syntax (no backreferences or lookarounds): "
                         f"{why}") from None
    if compiled.search("") is not None:
        raise ValueError(f"sampling_params.stop_regex {pattern!r} matches the empty string")
    partial = None
    if not _FOLDS_CASE.search(pattern):
        try:
            partial = regex.compile(pattern, regex.ASCII)
        except (regex.error, RecursionError, OverflowError):
            pass
    return StopPattern(pattern, compiled, partial,
                       max(compiled.programsize + compiled.reverseprogramsize, 1))


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
    patterns: tuple[StopPattern, ...] = ()

    @classmethod
    def of(cls, sampling: SamplingParams) -> Stops:
        """Raises ValueError for a bad pattern (checked at the edge, before any work)."""
        regexes = sampling.stop_regex
        regexes = [] if regexes is None else [regexes] if isinstance(regexes, str) else regexes
        return cls(tuple(sampling.stop_strings()), tuple(map(compile_stop_regex, regexes)))

    def __bool__(self) -> bool:
        return bool(self.strings or self.patterns)

    def window(self, num_output: int) -> int:
        """Where the text to search for stop strings begins, as an index into the output
        tokens. A stop string the newest token completed spans at most `len(stop)`
        characters, and no token decodes to nothing but a few partial UTF-8 bytes, so that
        many tokens plus a margin suffice. (Patterns: `resume_at`.)"""
        if not self.strings:
            return num_output
        return max(0, num_output - max(len(s) for s in self.strings) - 4)

    def find(self, text: str, after: int = 0, only: str | None = None, pos: int = 0,
             budget: SearchBudget | None = None) -> StopMatch | None:
        """The stop whose match ends past `after` and starts first in `text` (a stop string
        before a pattern at the same place; one new token can complete several at once,
        such as "\\n " for stops [" ", "\\n"]). With `only`, just that stop. A pattern's
        match begins at `pos` or later (the text before it is context for `^` and `\\b`).
        With `budget`, each pattern search is paid for before it runs (SearchOverBudget)."""
        found = []
        for s in self.strings:
            at = text.find(s, max(0, after - len(s) + 1)) if only in (None, s) else -1
            if at >= 0:
                found.append(StopMatch(s, at, at + len(s)))
        for p in self.patterns:
            m = _first_match(p, text, after, pos, budget) if only in (None, p.pattern) else None
            if m is not None:
                found.append(StopMatch(p.pattern, m.start(), m.end()))
        return min(found, key=lambda m: m.start, default=None)

    def resume_at(self, text: str, pos: int, after: int = 0,
                  budget: PartialBudget | None = None) -> int:
        """The first place in `text`, from `pos`, where a pattern's match that counts (ends
        past `after`) may still begin: a match, or a partial one that more text may
        complete; `len(text)` when none may. PartialTimeout when the searches ran past
        `budget` (the request's; by default a fresh one), or a pattern's partial matches
        are not looked for."""
        budget = budget if budget is not None else PartialBudget()
        at = len(text)
        for p in self.patterns:
            if p.partial is None or budget.left <= 0:
                raise PartialTimeout(p.pattern)
            started = time.perf_counter()
            try:
                m = p.partial.search(text, pos, partial=True, timeout=budget.left)
                while m is not None and not m.partial and m.end() <= after:
                    m = p.partial.search(text, m.start() + 1, partial=True,
                                         timeout=max(budget.left - (time.perf_counter()
                                                                    - started), 1e-6))
            except TimeoutError:
                budget.left = 0.0
                raise PartialTimeout(p.pattern) from None
            finally:
                budget.left -= time.perf_counter() - started
            if m is not None:
                at = min(at, m.start())
        return at

    def shown(self, text: str, after: int, start: int,
              budget: PartialBudget | None = None) -> int:
        """How much of `text` a stream may show, given it showed `start` characters: all
        but a tail that is or may still become a stop's match, so that what it shows is
        never trimmed from the final text. A match cannot begin in text already shown: no
        partial match did back then. PartialTimeout: see `resume_at`."""
        safe = len(text) - max((len(s) - 1 for s in self.strings), default=0)
        if self.patterns:
            safe = min(safe, self.resume_at(text, start, after, budget))
        return safe


def _first_match(pattern: StopPattern, text: str, after: int, pos: int = 0,
                 budget: SearchBudget | None = None) -> Any:
    """The first match of `pattern` in `text` from `pos` that ends past `after`; searching
    from `pos` keeps the text before it as context for `^` and `\\b`. Each search is paid
    for first from `budget`, if given."""
    start = pos
    while True:
        if budget is not None:
            budget.spend(pattern.cost * (len(text) - start + 1), pattern.pattern)
        m = pattern.engine.search(text, start)
        if m is None or m.end() > after:
            return m
        start = m.start() + 1


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
