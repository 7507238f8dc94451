"""Anthropic's Messages API (issue 55) through the `anthropic` client, unchanged: a tool-use
round trip plain and streamed (the streamed call equal to the plain one), count_tokens equal
to the prompt tokens the request then reports, greedy text equal to Chat Completions',
stop_sequences, the `x-api-key` header, and Anthropic's error shape naming what is refused.
The model is random, so the call is forced (`tool_choice` tool), which makes each answer
deterministic under greedy sampling."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import AGENT_KEY_A, assert_idle_and_all_free

MODEL = "tiny"
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "additionalProperties": False,
                            "required": ["city"],
                            "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}}}}
SYSTEM = "You answer weather questions with the get_weather tool."
ASK = [{"role": "user", "content": "What is the weather in Rome?"}]
GREEDY = {"temperature": 0}
"""The `anthropic` client no longer has a temperature argument; the API still takes it."""


@pytest.fixture(scope="module")
def client(agents_runtime):
    with anthropic.Anthropic(base_url=agents_runtime.http_url, api_key=AGENT_KEY_A,
                             timeout=300, max_retries=0) as c:
        yield c


def _round_trip(client, stream: bool):
    """Ask, get a forced get_weather call, answer it with its result, get text."""
    forced = dict(model=MODEL, max_tokens=32, system=SYSTEM, tools=[WEATHER], extra_body=GREEDY,
                  tool_choice={"type": "tool", "name": "get_weather"})
    if stream:
        with client.messages.stream(messages=ASK, **forced) as s:
            kinds = [event.type for event in s]
            first = s.get_final_message()
    else:
        first, kinds = client.messages.create(messages=ASK, **forced), []
    (call,) = first.content
    assert call.type == "tool_use" and call.name == "get_weather"
    assert call.input["city"] in ("Paris", "Rome", "Oslo")
    assert first.stop_reason == "tool_use"
    history = ASK + [{"role": "assistant", "content": [c.model_dump() for c in first.content]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": call.id,
                          "content": [{"type": "text", "text": "sunny, 20 C"}]}]}]
    answer = client.messages.create(model=MODEL, max_tokens=6, system=SYSTEM,
                                    tools=[WEATHER], messages=history, extra_body=GREEDY,
                                    tool_choice={"type": "none"})
    assert answer.content[0].type == "text" and answer.stop_reason == "max_tokens"
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, tools=[WEATHER],
                                           messages=history, tool_choice={"type": "none"})
    usage = answer.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens
    return call, kinds


def test_a_tool_use_round_trip_plain_and_streamed(client):
    plain, _ = _round_trip(client, stream=False)
    streamed, kinds = _round_trip(client, stream=True)
    assert streamed.input == plain.input
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "input_json" in kinds
    assert kinds[-2] == "message_delta" and "content_block_stop" in kinds


def test_greedy_text_equals_chat_completions(agents_runtime, client):
    conversation = [{"role": "user", "content": "Say hello."},
                    {"role": "assistant", "content": "Hello!"},
                    {"role": "user", "content": "Again, louder."}]
    with openai.OpenAI(base_url=f"{agents_runtime.http_url}/v1", api_key=AGENT_KEY_A,
                       max_retries=0, timeout=300) as oai:
        chat = oai.chat.completions.create(
            model=MODEL, extra_body=GREEDY, max_tokens=20,
            messages=[{"role": "system", "content": "Be brief."}, *conversation])
    message = client.messages.create(model=MODEL, system=[{"type": "text", "text": "Be brief."}],
                                     messages=conversation, max_tokens=20, extra_body=GREEDY)
    assert message.content[0].text == chat.choices[0].message.content
    assert (message.usage.input_tokens + message.usage.cache_read_input_tokens
            == chat.usage.prompt_tokens)
    with client.messages.stream(model=MODEL, system="Be brief.", messages=conversation,
                                max_tokens=20, extra_body=GREEDY) as s:
        text = "".join(s.text_stream)
    assert text == chat.choices[0].message.content


def test_a_stop_sequence_is_reported(client):
    free = client.messages.create(model=MODEL, messages=ASK, max_tokens=16, extra_body=GREEDY)
    word = free.content[0].text.split()[2] if len(free.content[0].text.split()) > 2 else None
    if word is None:
        pytest.skip("the random model wrote fewer than three words")
    cut = client.messages.create(model=MODEL, messages=ASK, max_tokens=16, extra_body=GREEDY,
                                 stop_sequences=[word])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word


def test_the_x_api_key_header_is_a_tenant_key(agents_runtime):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 1}
    ok = httpx.post(f"{agents_runtime.http_url}/v1/messages", json=body,
                    headers={"x-api-key": AGENT_KEY_A}, timeout=300)
    assert ok.status_code == 200 and ok.json()["type"] == "message"
    bad = httpx.post(f"{agents_runtime.http_url}/v1/messages", json=body,
                     headers={"x-api-key": "sk-wrong"}, timeout=300)
    assert bad.status_code == 401


@pytest.mark.parametrize("body,words", [
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AAAA"}}]}]},
     "messages[0].content[0]: content of type 'image' is not supported"),
    ({"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "data": "x",
                                        "media_type": "text/plain"}}]}]},
     "'document' is not supported"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools[0]: tools of type 'web_search_20250305' are not supported"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                 "input": {}}]}]},
     "a tool_use block belongs in an assistant message"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     "needs tool_use_id"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]},
     "tool_choice names the function 'nope'"),
    ({"messages": []}, "messages must not be empty"),
])
def test_what_is_refused_is_named_in_anthropics_error_shape(client, body, words):
    ask = {"model": MODEL, "messages": ASK, "max_tokens": 2, **body}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**ask)
    error = e.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"], error


def test_idle_and_all_free(agents_admin):
    assert_idle_and_all_free(agents_admin)
