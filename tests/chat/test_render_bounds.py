"""Issue 41, finding 6: a run of tool results merges into one user turn in time linear in
its text (it was quadratic: two 9.3 MB chats held both render threads ~35 s), and a chat
request's messages and parts are bounded at decode."""

from __future__ import annotations

import re
import time

import msgspec
import pytest

from radixserve.chat.prompt import _hermes
from radixserve.server.http import openai_protocol as proto


def merge_seconds(results: int) -> float:
    messages = [{"role": "user", "content": "go"}]
    messages += [{"role": "tool", "content": "r" * 2000} for _ in range(results)]
    began = time.perf_counter()
    out = _hermes(messages, None)
    took = time.perf_counter() - began
    assert [m["role"] for m in out] == ["user", "user"]
    assert out[1]["content"].count("<tool_response>") == results
    return took


def test_tool_results_merge_in_linear_time():
    small, large = merge_seconds(400), merge_seconds(4000)
    # ten times the results: ~10x linear, ~100x quadratic; generous for a loaded machine
    assert large < 40 * max(small, 1e-3), (small, large)


def test_results_between_turns_stay_apart():
    out = _hermes([{"role": "tool", "content": "a"}, {"role": "assistant", "content": "b"},
                   {"role": "tool", "content": "c"}, {"role": "tool", "content": "d"}], None)
    assert [m["content"] for m in out] == [
        "<tool_response>\na\n</tool_response>", "b",
        "<tool_response>\nc\n</tool_response>\n<tool_response>\nd\n</tool_response>"]


@pytest.mark.parametrize("body, where", [
    ({"messages": [{"role": "tool", "content": "x"}] * (proto.MAX_CHAT_MESSAGES + 1)},
     "$.messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]
                    * (proto.MAX_CHAT_PARTS + 1)}]}, "$.messages[0].content"),
])
def test_chat_messages_and_parts_are_bounded_at_decode(body, where):
    bound = rf"length <= \d+ - at `{re.escape(where)}`"
    with pytest.raises(msgspec.ValidationError, match=bound):
        msgspec.json.decode(msgspec.json.encode({"model": "m", **body}), type=proto.ChatRequest)
