"""Stops on plain text: which match counts (first, past `after`), what a stream may show,
how the final text is cut, which patterns are refused."""

from __future__ import annotations

import re
import time

import pytest

from radixserve.messages import SamplingParams
from radixserve.stop_strings import (SEARCH_STEP_UNITS, STOP_REGEX_MAX_MEM, PartialBudget,
                                     PartialTimeout, SearchBudget, StopMatch, Stops, trim)


def stops(stop=None, stop_regex=None) -> Stops:
    return Stops.of(SamplingParams(stop=stop, stop_regex=stop_regex))


def test_the_first_match_wins_a_string_before_a_pattern_at_the_same_place():
    s = stops(stop=["b c", "c"], stop_regex=[r"b\s", r"a+"])
    assert s.find("xx b c aa").matched == "b c"
    assert s.find("xx aa b c").matched == "a+"
    assert (s.find("xx aa").start, s.find("xx aa").end) == (3, 5)
    assert s.find("none here") is None


def test_only_a_match_that_ends_past_after_counts():
    s = stops(stop=[","], stop_regex=[r"\d,"])
    assert s.find("4, 5,", after=2) == StopMatch(r"\d,", 3, 5)
    assert s.find("4, 5,", after=1) == StopMatch(r"\d,", 0, 2)  # "4," ends at 2 > 1
    assert stops(stop=[","]).find("4, 5,", after=2) == StopMatch(",", 4, 5)
    assert s.find("4, 5,", after=5) is None


def test_a_stream_shows_all_but_what_may_become_a_match():
    assert stops(stop=["STOP"]).shown("one STO", 0, 0) == 4  # "STO" may become "STOP"
    s = stops(stop_regex=[r"\d+ apples"])
    assert s.shown("I have 12", 0, 0) == 7  # "12" may become "12 apples"
    assert s.shown("I have 12 app", 0, 0) == 7
    assert s.shown("I have 12 or", 0, 0) == 12  # ... no longer
    assert s.shown("I have 12 apples", 16, 0) == 16  # a match that does not count


def test_trim_cuts_before_the_match_or_after_it():
    s = stops(stop=["END"], stop_regex=[r"[0-9]+\."])
    assert trim("ab 12. cd 3.", r"[0-9]+\.", s, 0, keep_stop=False) == "ab "
    assert trim("ab 12. cd 3.", r"[0-9]+\.", s, 0, keep_stop=True) == "ab 12."
    assert trim("ab 12. cd 3.", r"[0-9]+\.", s, 6, keep_stop=False) == "ab 12. cd "
    assert trim("xENDy", "END", s, 0, keep_stop=True) == "xEND"
    assert trim("xENDy", 7, s, 0, keep_stop=False) == "xENDy"  # a stop token: not here


@pytest.mark.parametrize("pattern, words", [("(", "not a valid regular expression"),
                                            ("x?", "matches the empty string")])
def test_bad_patterns_name_the_field(pattern, words):
    with pytest.raises(ValueError, match=rf"sampling_params\.stop_regex .*{words}"):
        stops(stop_regex=["fine", pattern])


# -- issue 25, class 4: a caller's pattern never runs unbounded -------------------------

def test_a_backtracking_pattern_matches_in_linear_time():
    s = stops(stop_regex=[r"(a|aa)+b"])  # exponential in `re` over a run of a's
    text = "a" * 20000
    started = time.monotonic()
    assert s.find(text) is None
    with pytest.raises(PartialTimeout):  # where a match may begin: not told in time
        s.shown(text, 0, 0)
    assert time.monotonic() - started < 10  # RE2: milliseconds; the partial search: 50 ms
    assert s.find(text + "b") == StopMatch(r"(a|aa)+b", 0, 20001)


@pytest.mark.parametrize("pattern", [r"(a)\1", r"(?<=a)b", r"a(?=b)", r"a++", r"(?>a)b"])
def test_patterns_re2_cannot_run_are_refused_by_name(pattern):
    with pytest.raises(ValueError, match=r"sampling_params\.stop_regex .* not a valid regular "
                       r"expression in RE2's syntax \(no backreferences or lookarounds\)"):
        stops(stop_regex=[pattern])


class _Req:
    """What scheduler/finish.py's check_finish reads of a request: one character per token."""

    def __init__(self, pattern: str, min_new_tokens: int = 0) -> None:
        self.sampling = SamplingParams(stop_regex=pattern, min_new_tokens=min_new_tokens)
        self.stops = Stops.of(self.sampling)
        self.output_ids: list[int] = []
        self.stop_from, self.stop_budget = 0, SearchBudget()


def _decode(ids, *, skip_special_tokens, spaces_between_special_tokens):
    return "".join(map(chr, ids))


TEXT = ("I have 12 oranges and 7 apples today.\nThe end, then x and 6, 9,\n\n\nAn "
        "answer: a long b. STOP here, aab ")


@pytest.mark.parametrize("pattern", [r"\d+ apples", r"[6-9],", r"\bend\b", r"^I have",
                                     r"^x", r"a.*b\.", r"\n\n+", r"(?i:stop)", r"answer: .*b",
                                     r"(a|aa)+b", r"zzz"])
@pytest.mark.parametrize("min_new_tokens", [0, 12])
def test_searching_only_what_new_tokens_change_stops_where_the_whole_output_does(
        pattern, min_new_tokens):
    """The scheduler searches from where a match may still begin: it stops at the same
    token as a search of the whole output with Python's `re` at every step."""
    from radixserve.scheduler.finish import _find_stop

    req = _Req(pattern, min_new_tokens)
    expected = got = None
    after = len(TEXT[:max(min_new_tokens - 1, 0)])
    for n in range(1, len(TEXT) + 1):
        m = next((m for m in re.finditer(f"(?=({pattern}))", TEXT[:n], re.ASCII)
                  if m.start() + len(m.group(1)) > after), None)
        if expected is None and m is not None and n >= min_new_tokens:
            expected = n
        req.output_ids.append(ord(TEXT[n - 1]))
        if got is None and n >= min_new_tokens and _find_stop(req, _decode) is not None:
            got = n
    assert got == expected
    if pattern == "zzz":
        assert req.stop_from >= len(TEXT) - 8  # the search window moved along


def test_a_requests_partial_searches_share_one_budget():
    """Many searches each under the bound add up: the budget is the request's, all searches
    together, so a pattern slow at every step costs the loop PARTIAL_SECONDS once."""
    s = stops(stop_regex=[r"(a|aa)+b"])
    budget = PartialBudget(0.05)
    spent = 0
    started = time.monotonic()
    for n in range(10, 40):  # each search longer than the last
        try:
            s.resume_at("a" * n, 0, budget=budget)
        except PartialTimeout:
            spent += 1
    assert budget.left <= 0 and spent >= 1
    assert time.monotonic() - started < 5  # once spent, no search runs at all


def test_an_outputs_stop_searches_end_at_their_total_budget():
    """Issue 41, finding 2: a case-insensitive pattern has no partial matches, so every step
    searched the whole output with every pattern (another tenant's latency went from 0.38 s
    to 7.65 s). The output's searches together now end it with an abort naming the bound,
    after about SEARCH_SECONDS of the loop's time, however long it would have run."""
    from radixserve.scheduler.finish import check_finish

    req = _Req([r"(?i)never here"] * 64)
    req.sampling = SamplingParams(stop_regex=[r"(?i)never here"] * 64, max_new_tokens=100_000)
    req.grammar = None
    req.stop_budget = SearchBudget(search_seconds=0.05)
    began, finish = time.perf_counter(), None
    while finish is None and len(req.output_ids) < 100_000:
        req.output_ids.append(ord("a"))
        finish = check_finish(req, (), _decode)
    took = time.perf_counter() - began
    assert finish is not None and finish["type"] == "abort", finish
    assert "stop_regex" in finish["message"] and "budget" in finish["message"]
    assert len(req.output_ids) < 100_000 and took < 5.0, (len(req.output_ids), took)


def test_a_search_a_step_cannot_pay_for_ends_the_output_before_it_runs():
    """Issue 53, finding 2: the search is priced (program size x characters) before it
    runs, so one that would take more than a step's share ends the output at once, without
    running: the step is not held, whatever the text and the pattern."""
    from radixserve.scheduler.finish import check_finish

    heavy = r"(?:[a-c]{1,40}d){1,20}e"  # fits RE2's bound, costly per character
    for samples in (1, 8):
        req = _Req([heavy] * 4)
        req.sampling = SamplingParams(stop_regex=[heavy] * 4, n=samples, max_new_tokens=10**6)
        req.grammar = None
        req.stop_budget = SearchBudget(samples)
        finish = None
        began = time.perf_counter()
        while finish is None:
            req.output_ids.append(ord("a"))  # "a"s keep a partial match open: text grows
            finish = check_finish(req, (), _decode)
        assert finish["type"] == "abort" and "step budget" in finish["message"], finish
        assert f"{SEARCH_STEP_UNITS // samples:,}" in finish["message"]
        assert time.perf_counter() - began < 10
        per_char = sum(p.cost for p in req.stops.patterns)
        assert per_char * len(req.output_ids) > SEARCH_STEP_UNITS // samples / 2


@pytest.mark.parametrize("pattern", [
    "(?:" + "|".join(f"(?:[a-z]{{1,{i % 60 + 2}}}{chr(97 + i % 26)}){{1,{i % 9 + 2}}}"
                     for i in range(60)) + ")z",
    "(?:[^a]{1,200}b){1,5}(?:[^c]{1,200}d){1,5}(?:[^e]{1,200}f){1,5}",
    "|".join(f"(?:q{{{i}}}[^r]{{1,60}})" for i in range(10, 300, 5))])
def test_a_stop_regex_over_re2s_memory_bound_is_refused_quickly(pattern):
    """Issue 53, finding 4a: a kilobyte of nested counted repeats compiled for 70-140 ms and
    held ~0.9 MB per cached pattern. Programs over STOP_REGEX_MAX_MEM are refused by name,
    and the refusal itself is cheap."""
    began = time.perf_counter()
    with pytest.raises(ValueError, match=r"sampling_params\.stop_regex .* too large: its RE2 "
                       rf"program does not fit in {STOP_REGEX_MAX_MEM >> 10} KiB"):
        stops(stop_regex=[pattern])
    assert time.perf_counter() - began < 0.5
