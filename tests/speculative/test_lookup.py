"""Prompt lookup (speculative/lookup.py): what a sequence's own tokens propose."""

from __future__ import annotations

import random

from radixserve.speculative.lookup import ContextLookup


def lookup(tokens: list[int], **kw: int) -> ContextLookup:
    c = ContextLookup(**kw)
    c.extend(tokens)
    return c


def test_a_copied_phrase_proposes_what_followed_it() -> None:
    # "... 10 11 12 13 14 ..." earlier; the tail is copying it again.
    c = lookup([1, 2, 10, 11, 12, 13, 14, 3, 4, 10, 11])
    assert c.propose(3) == [12, 13, 14]
    assert c.propose(1) == [12]
    assert c.propose(0) == []


def test_the_longest_match_wins_and_the_latest_occurrence_of_it() -> None:
    # [7, 8] was followed by 1 and later by 2; [6, 7, 8] only by 3: the longer match wins.
    c = lookup([6, 7, 8, 3, 0, 7, 8, 1, 0, 7, 8, 2, 0, 6, 7, 8])
    assert c.propose(1) == [3]
    # Without the longer match, the latest occurrence of [7, 8] proposes.
    c = lookup([7, 8, 1, 0, 7, 8, 2, 0, 5, 7, 8])
    assert c.propose(1) == [2]


def test_a_period_is_continued_past_the_end_of_the_context() -> None:
    assert lookup([5, 1, 2, 1, 2, 1, 2]).propose(5) == [1, 2, 1, 2, 1]
    assert lookup([9, 9, 9]).propose(4) == [9, 9, 9, 9]


def test_no_match_no_draft_and_single_tokens_do_not_match_by_default() -> None:
    assert lookup([]).propose(4) == []
    assert lookup([1, 2, 3, 4]).propose(4) == []
    # Only the single token 3 recurs: below min_ngram=2.
    assert lookup([3, 1, 2, 3]).propose(2) == []
    assert lookup([3, 1, 2, 3], min_ngram=1).propose(2) == [1, 2]


def test_feeding_in_pieces_equals_feeding_at_once() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(300)]
    whole = lookup(tokens)
    pieces = ContextLookup()
    i = 0
    while i < len(tokens):
        step = rng.randrange(1, 5)
        pieces.extend(tokens[i:i + step])
        i += step
        fed = tokens[:i]
        assert pieces.propose(4) == lookup(fed).propose(4) == _scan(fed, 4)
    assert pieces.propose(6) == whole.propose(6)


def _scan(tokens: list[int], max_len: int, max_n: int = 4, min_n: int = 2) -> list[int]:
    """The definition, by a scan of the whole context: the reference for the map."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        gram = tokens[len(tokens) - n:]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1:end + 1] == gram:
                seq = list(tokens)
                for i in range(end + 1, end + 1 + max_len):
                    seq.append(seq[i])
                return seq[len(tokens):]
    return []


def test_acceptance_on_repetitive_text_is_high() -> None:
    """A sequence that keeps quoting a few phrases: lookup guesses most of each quote's
    tokens right (the first token of a quote and the new token after it it cannot)."""
    rng = random.Random(1)
    phrases = [[rng.randrange(1000) for _ in range(12)] for _ in range(5)]
    seq = ContextLookup()
    right = 0
    for _ in range(40):
        text = rng.choice(phrases) + [rng.randrange(1000)]  # a quote, then something new
        for token in text:
            right += seq.propose(1) == [token]
            seq.extend([token])
    assert right / (40 * 13) > 0.6
