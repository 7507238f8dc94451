"""Streamed tool calls equal the calls parsed from the finished text, whatever the chunk
boundaries (issue 55): for every tool-call syntax radixserve reads under auto (Hermes,
Mistral's two, Llama 3's JSON), the same texts are cut at every position, then at random
(hypothesis), and the deltas of each cut merge to the whole text's message. Chat
Completions, Responses and Messages all stream through these parsers."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.chat.tool_calls.base import merge
from radixserve.chat.tool_calls.registry import PARSERS

NAMES = {"get_weather", "get_time"}

TEXTS: dict[str, list[str]] = {
    "hermes": [
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
        '</tool_call>  ',
        '<tool_call>{"name": "get_weather", "arguments": {"city": "a</tool_call>b"}}'
        '</tool_call> after',
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call> text <tool_ca',
        '  text with < and <tool and {"name": "get_time"} but no call  ',
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "{[}]\\"<tool_call>"}}',
    ],
    "mistral": [
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"zone": "UTC"}}]',
        'Sure. [TOOL_CALLS]{"name": "get_time", "arguments": {"zone": "]["}} done',
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
        'No tools. [1, 2] [TOOL',
        '[TOOL_CALLS]not a call',
        '[TOOL_CALLS][{"name": "unknown", "arguments": {}}] tail',
    ],
    "llama3": [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {"zone": "UTC"}}',
        '<|python_tag|>{"name": "get_time", "parameters": {"zone": "};{"}}',
        'The answer is {"name": "get_weather", "parameters": {"city": "Rome"}}',
        '{"name": "get_weather", "parameters": {"city": "Li',
        '{"not": "a call"} text',
    ],
}
CASES = [(fmt, text, parallel) for fmt, texts in TEXTS.items() for text in texts
         for parallel in (True, False)]


def _plain(message: tuple[str | None, list[dict[str, Any]]]) -> tuple[Any, ...]:
    """A message without its call ids (each parse draws new ones)."""
    content, calls = message
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def _streamed(fmt: str, parallel: bool, pieces: list[str]) -> tuple[Any, ...]:
    parser = PARSERS[fmt](NAMES, parallel)
    deltas = [d for piece in pieces for d in parser.feed(piece)] + parser.finish()
    return _plain(merge(deltas))


def _whole(fmt: str, parallel: bool, text: str) -> tuple[Any, ...]:
    return _plain(PARSERS[fmt](NAMES, parallel).parse(text))


def test_every_format_has_texts():
    assert set(TEXTS) == set(PARSERS)


@pytest.mark.parametrize("fmt,text,parallel", CASES)
def test_every_single_cut_streams_the_whole_answer(fmt, text, parallel):
    whole = _whole(fmt, parallel, text)
    for at in range(len(text) + 1):
        assert _streamed(fmt, parallel, [text[:at], text[at:]]) == whole, at
    assert _streamed(fmt, parallel, list(text)) == whole  # a character a chunk


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_random_cuts_stream_the_whole_answer(case, cuts):
    fmt, text, parallel = case
    points = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    assert _streamed(fmt, parallel, pieces) == _whole(fmt, parallel, text)


def _blocks(fmt: str, parallel: bool, pieces: list[str]) -> list[tuple[str, str, str]]:
    """The blocks the Responses and Messages APIs answer with (`turns.Blocks`), fed
    `pieces`: (kind, name, text or arguments) each."""
    from radixserve.chat.tool_plan import ToolPlan
    from radixserve.server.http.turns import Blocks

    plan = ToolPlan([], "auto", parallel, dict.fromkeys(NAMES, {}), False, fmt)
    blocks = Blocks(plan)
    for piece in pieces:
        blocks.feed(piece)
    blocks.finish()
    return [(b.kind, b.name, b.text) for b in blocks.blocks]


@settings(max_examples=200, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_the_agents_apis_blocks_stream_the_whole_answer(case, cuts):
    """Responses' output items and Messages' content blocks, streamed in any cut, are the
    blocks of the whole text, and their calls are the chat message's calls."""
    fmt, text, parallel = case
    points = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    whole = _blocks(fmt, parallel, [text])
    assert _blocks(fmt, parallel, pieces) == whole
    content, calls = _whole(fmt, parallel, text)
    assert [(name, args) for kind, name, args in whole if kind == "call"] == calls
    assert "".join(t for kind, _, t in whole if kind == "text") == (content or "")

