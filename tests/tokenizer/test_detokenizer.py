"""Incremental detokenization: the streamed pieces always add up to the full decode, never
show a broken character, and never show the start of a stop string."""

from __future__ import annotations

import pytest

from radixserve.messages import SamplingParams
from radixserve.tokenizer.detokenizer import IncrementalDetokenizer

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


def test_stop_string_start_is_held_back(tokenizer):
    """As in the server: the token that completes a stop string ends the request, and its
    text comes from `finish` (trimmed), never from `add`."""
    ids = tokenizer.encode("one two three STOP four")
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["STOP"]))
    shown = ""
    for i, t in enumerate(ids):
        text = tokenizer.decode(ids[:i + 1])
        if "STOP" in text:
            final = text[:text.index("STOP")]
            assert final.startswith(shown) and not shown.endswith(("S", "ST", "STO"))
            shown += detok.finish(final)
            break
        shown += detok.add([t])
    assert shown == "one two three "
