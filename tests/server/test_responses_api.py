"""OpenAI's Responses API (issue 55) through the official clients, unchanged: the Agents SDK's
default `OpenAIResponsesModel` runs an agent with two function tools through several turns,
chained by `previous_response_id`, each turn after the first prefilled from the cache; the
`openai` client's `responses.create` and `responses.stream` (events in order, the streamed
call equal to the plain one); stored responses read and deleted; greedy text equal to Chat
Completions'; what is refused, by name. The model is random, so tool calls are forced
(`tool_choice`), which makes every turn deterministic under greedy sampling."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import openai
import pytest

from tests.server.conftest import AGENT_KEY_A, assert_idle_and_all_free

MODEL = "tiny"
RULES = " ".join(f"Rule {i}: answer in one short sentence, and ask the weather and time tools "
                 "whenever a question needs them." for i in range(60))
"""Long instructions, as agents' system prompts are: the prefix every turn shares."""
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "additionalProperties": False,
                          "required": ["city"],
                          "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}}},
           "strict": True}


@pytest.fixture(scope="module")
def client(agents_runtime):
    with openai.OpenAI(base_url=f"{agents_runtime.http_url}/v1", api_key=AGENT_KEY_A,
                       timeout=300, max_retries=0) as c:
        yield c


def test_the_agents_sdk_runs_two_tools_over_chained_cached_turns(agents_runtime, client):
    from agents import Agent, ModelSettings, Runner, function_tool
    from agents.models.openai_responses import OpenAIResponsesModel

    called: list[tuple[str, str]] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
        """The weather in a city."""
        called.append(("get_weather", city))
        return f"sunny in {city}"

    @function_tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time in a timezone."""
        called.append(("get_time", zone))
        return f"noon {zone}"

    async def run() -> list:
        aio = openai.AsyncOpenAI(base_url=f"{agents_runtime.http_url}/v1",
                                 api_key=AGENT_KEY_A, timeout=300, max_retries=0)
        # required, one call: every turn offers both tools (the prompt's tools section
        # stays the same) and its answer is a call, constrained JSON that ends by itself;
        # the run stops on it, its result the final output (a random model's free text
        # would run to max_tokens, which the SDK takes for a failure)
        agent = Agent(name="assistant", instructions=RULES, tools=[get_weather, get_time],
                      model=OpenAIResponsesModel(model=MODEL, openai_client=aio),
                      tool_use_behavior="stop_on_first_tool",
                      model_settings=ModelSettings(tool_choice="required", temperature=0,
                                                   max_tokens=48, parallel_tool_calls=False))
        results, previous = [], None
        for question in ("Weather in Paris?", "And the time in Berlin?", "Rome, then?",
                         "Oslo?"):
            result = await Runner.run(agent, question, previous_response_id=previous)
            previous = result.last_response_id
            results.append(result)
        await aio.close()
        return results

    results = asyncio.run(run())
    responses = [r for result in results for r in result.raw_responses]
    try:
        assert len(responses) == 4  # per run, one turn: the call
        assert len(called) == 4 and all(name in ("get_weather", "get_time")
                                        for name, _ in called)
        for result, (_, arg) in zip(results, called):
            assert result.final_output in (f"sunny in {arg}", f"noon {arg}")
        fractions = []
        for turn in responses:
            details = turn.usage.input_tokens_details
            fractions.append(details.cached_tokens / turn.usage.input_tokens)
        print("cached fraction per turn:", [round(f, 3) for f in fractions])
        assert all(f >= 0.9 for f in fractions[1:]), fractions
        stored = client.responses.retrieve(responses[-1].response_id)
        assert stored.id == responses[-1].response_id and stored.usage is not None
    finally:
        for turn in responses:
            client.responses.delete(turn.response_id)


def test_the_agents_sdk_streams_a_run(agents_runtime):
    """Runner.run_streamed reads the Responses stream's events into a finished run."""
    from agents import Agent, ModelSettings, Runner, function_tool
    from agents.models.openai_responses import OpenAIResponsesModel

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    async def run() -> tuple[object, set[str]]:
        aio = openai.AsyncOpenAI(base_url=f"{agents_runtime.http_url}/v1",
                                 api_key=AGENT_KEY_A, timeout=300, max_retries=0)
        agent = Agent(name="assistant", instructions="Be brief.", tools=[get_weather],
                      model=OpenAIResponsesModel(model=MODEL, openai_client=aio),
                      tool_use_behavior="stop_on_first_tool",
                      model_settings=ModelSettings(tool_choice="get_weather", temperature=0,
                                                   max_tokens=32, store=False))
        result = Runner.run_streamed(agent, "Weather?")
        kinds = {getattr(e.data, "type", "") async for e in result.stream_events()
                 if e.type == "raw_response_event"}
        await aio.close()
        return result.final_output, kinds

    final, kinds = asyncio.run(run())
    assert final in ("sunny in Paris", "sunny in Rome")
    assert {"response.created", "response.function_call_arguments.delta",
            "response.output_item.done", "response.completed"} <= kinds


def test_a_forced_call_streams_the_same_call_and_events_in_order(client):
    ask = dict(model=MODEL, input="Weather in Rome?", tools=[WEATHER], store=False,
               tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
               max_output_tokens=24)
    plain = client.responses.create(**ask)
    (call,) = plain.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome", "Oslo")
    with client.responses.stream(**ask) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert "response.function_call_arguments.delta" in kinds
    assert kinds[-3:] == ["response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    assert final.output[0].arguments == call.arguments
    assert final.usage.input_tokens == plain.usage.input_tokens


def test_greedy_text_equals_chat_completions_and_streams_the_same(client):
    conversation = [{"role": "user", "content": "Say hello."},
                    {"role": "assistant", "content": "Hello!"},
                    {"role": "user", "content": "Again, louder."}]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."}, *conversation],
        temperature=0, max_tokens=20)
    response = client.responses.create(model=MODEL, instructions="Be brief.",
                                       input=conversation, temperature=0,
                                       max_output_tokens=20, store=False)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    with client.responses.stream(model=MODEL, instructions="Be brief.", input=conversation,
                                 temperature=0, max_output_tokens=20, store=False) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == chat.choices[0].message.content


def test_a_json_schema_format_is_enforced_and_a_stored_response_read_then_deleted(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["city"],
              "properties": {"city": {"enum": ["Paris", "Oslo"]}}}
    response = client.responses.create(
        model=MODEL, input="A city?", max_output_tokens=24, metadata={"run": "1"},
        text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                         "strict": True}})
    assert json.loads(response.output_text)["city"] in ("Paris", "Oslo")
    got = client.responses.retrieve(response.id)
    assert got.output_text == response.output_text and got.metadata == {"run": "1"}
    nxt = client.responses.create(model=MODEL, input="Another?", max_output_tokens=4,
                                  previous_response_id=response.id, store=False)
    assert nxt.previous_response_id == response.id
    assert nxt.usage.input_tokens_details.cached_tokens > 0
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError, match="no stored response"):
        client.responses.retrieve(response.id)


@pytest.mark.parametrize("body,param,words", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "'web_search' are not supported"),
    ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]},
     "tools[0].type", "no hosted tools"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[0]", "'input_image' is not supported"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", "'reasoning'"),
    ({"background": True}, "background", "background is not supported"),
    ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0]",
     "needs call_id"),
    ({"previous_response_id": "resp_nope"}, "previous_response_id", "no stored response"),
])
def test_what_is_refused_is_named(client, body, param, words):
    ask = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, **body}
    with pytest.raises(openai.APIStatusError) as e:
        client.responses.create(**ask)
    error = e.value.body
    assert e.value.status_code in (400, 404) and error["param"] == param, error
    assert words in error["message"], error


def test_idle_and_all_free(agents_admin):
    assert_idle_and_all_free(agents_admin)
