"""Incremental detokenization: the streamed pieces always add up to the full decode, never
show a broken character, and never show the start of a stop string."""

from __future__ import annotations

import pytest

from radixserve.messages import SamplingParams
from radixserve.stop_strings import Stops
from radixserve.front_door.detokenizer import IncrementalDetokenizer

TEXTS = ["Plain ASCII, with spaces and punctuation!", "Café crème, naïve façade — 日本語のテキスト",
         "Emoji 🎉🎉 and 👩‍👩‍👧 families", "  leading spaces\n\nand newlines\t tabs"]


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_add_up_to_the_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add([t]) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(pieces) + detok.finish(full) == full
    assert "".join(pieces) == full  # nothing was held back without stop strings


def stream(tokenizer, text: str, sampling: SamplingParams) -> tuple[str, list[str]]:
    """As in the server: the token that completes a stop ends the request, and its text
    comes from `finish` (trimmed), never from `add`. Returns what was shown, and what had
    been shown before each token."""
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, sampling)
    stops, shown, history = Stops.of(sampling), "", []
    for i, t in enumerate(ids):
        history.append(shown)
        text = tokenizer.decode(ids[:i + 1])
        found = stops.find(text)
        if found is not None:
            final = text[:found.start]
            assert final.startswith(shown), (final, shown)
            return shown + detok.finish(final), history
        shown += detok.add([t])
    return shown + detok.finish(tokenizer.decode(ids)), history


def test_stop_string_start_is_held_back(tokenizer):
    shown, history = stream(tokenizer, "one two three STOP four", SamplingParams(stop=["STOP"]))
    assert shown == "one two three "
    assert not any(h.endswith(("S", "ST", "STO")) for h in history)


def test_a_partial_stop_regex_match_is_held_back_and_released(tokenizer):
    r""""12" could begin a match of `\d+ apples` until "oranges" comes: it is shown then,
    and "7 apples" never is."""
    sampling = SamplingParams(stop_regex=r"\d+ apples")
    shown, history = stream(tokenizer, "I have 12 oranges and 7 apples today", sampling)
    assert shown == "I have 12 oranges and "
    assert not any("12" in h for h in history if "oranges" not in h)
    assert not any("7" in h for h in history)


def test_a_pattern_whose_partial_matches_take_too_long_holds_the_rest_back(tokenizer):
    """Issue 25, class 4: where `(a|aa)+b` may begin over a run of a's takes `regex`
    exponential time; past PARTIAL_SECONDS the stream holds the rest back (one search, not
    one per token) and the end gives it all."""
    text = "Say " + "a" * 60 + " done"
    shown, history = stream(tokenizer, text, SamplingParams(stop_regex=r"(a|aa)+b"))
    assert shown == text
    held = [h for h in history if h.startswith("Say")]
    assert all(h == history[-1] for h in held[-10:])  # nothing more shown once held
    assert "done" not in history[-1]
