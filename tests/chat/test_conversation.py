"""The one conversion of a conversation into the chat template's messages that the Chat
Completions, Responses and Messages APIs share (`chat.conversation`)."""

from __future__ import annotations

import pytest

from radixserve.chat.conversation import Conversation, text_of
from radixserve.chat.errors import ChatError


def test_a_continued_conversation_leaves_the_stored_one_as_it_was():
    stored = Conversation(8)
    stored.say("user", "Weather?", "input")
    stored.call("c1", "get_weather", '{"city": "Rome"}', "output")
    before = [dict(m, tool_calls=list(m.get("tool_calls", []))) for m in stored.messages]
    talk = Conversation(8)
    talk.extend(stored.messages, "previous_response_id")
    talk.call("c2", "get_time", '{"zone": "UTC"}', "input[0]")  # joins the stored turn
    assert len(talk.messages[-1]["tool_calls"]) == 2
    assert [dict(m, tool_calls=m.get("tool_calls", [])) for m in stored.messages] == before


def test_calls_join_their_assistant_turn_and_results_follow():
    talk = Conversation(8)
    talk.say("developer", "Be brief.", "instructions")
    talk.say("assistant", "Let me look.", "input[0]")
    talk.call("c1", "f", "{}", "input[1]")
    talk.call("c2", "g", "{}", "input[2]")
    talk.result("c1", "done", "input[3]")
    assert [m["role"] for m in talk.messages] == ["system", "assistant", "tool"]
    assert [c["id"] for c in talk.messages[1]["tool_calls"]] == ["c1", "c2"]


def test_bounds_and_parts_that_are_not_text_are_named():
    talk = Conversation(1)
    talk.say("user", "a", "input[0]")
    with pytest.raises(ChatError, match=r"input\[1\]: the conversation holds more than 1"):
        talk.result("c", "x", "input[1]")
    with pytest.raises(ChatError, match=r"input\[0\].content\[1\]: content of type 'image'"):
        text_of([("text", "a"), ("image", None)], ("text",), "input[0].content")
