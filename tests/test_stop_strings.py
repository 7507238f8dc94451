"""Stops on plain text: which match counts (first, past `after`), what a stream may show,
how the final text is cut, which patterns are refused."""

from __future__ import annotations

import pytest

from radixserve.messages import SamplingParams
from radixserve.stop_strings import StopMatch, Stops, trim


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
