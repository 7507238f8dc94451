"""The OpenAI API as agents use it, through the official `openai` client: structured outputs
(json_schema, json_object), tool calls (required, a named function, auto; plain and
streamed; parallel), a tool loop, logit_bias, the fields clients send routinely, and 400s
that name the problem while the server keeps serving."""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.server.conftest import API_KEY, assert_idle_and_all_free

MODEL = "smollm2-135m"

CITY = {"type": "object", "additionalProperties": False,
        "required": ["city", "rainy", "code"],
        "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                       "rainy": {"type": "boolean"},
                       "code": {"type": "string", "pattern": "^[A-Z]{3}$"}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone.",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                   "required": ["zone"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
SYSTEM = {"role": "system", "content": "You answer weather questions with the get_weather tool."}


def ask(text: str) -> list[dict[str, Any]]:
    return [SYSTEM, {"role": "user", "content": text}]


def few_shot(groups: list[list[str]], question: str) -> list[dict[str, Any]]:
    """A conversation in which the assistant answered each earlier question by calling
    get_weather once per city, then answering from the results; then `question`."""
    messages = [SYSTEM]
    for i, cities in enumerate(groups):
        ids = [f"call_{i}_{city}" for city in cities]
        messages += [
            {"role": "user", "content": f"What is the weather in {' and in '.join(cities)}?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": id_, "type": "function", "function": {
                    "name": "get_weather", "arguments": json.dumps({"city": city})}}
                for id_, city in zip(ids, cities)]},
            *({"role": "tool", "tool_call_id": id_, "content": "sunny, 20 C"} for id_ in ids),
            {"role": "assistant", "content": f"It is sunny and 20 C in {' and '.join(cities)}."}]
    return messages + [{"role": "user", "content": question}]


ONE_CITY = few_shot([["Paris"], ["Tokyo"], ["Lima"]], "What is the weather in Berlin?")
TWO_CITIES = few_shot([["Paris"], ["Tokyo", "Lima"], ["Oslo", "Cairo"]],
                      "What is the weather in Berlin and in Rome?")


@pytest.fixture(scope="module")
def oai(http_runtime):
    with openai.OpenAI(base_url=http_runtime.http_url + "/v1", api_key=API_KEY,
                       max_retries=0, timeout=300) as client:
        yield client


def chat(oai, **kw: Any) -> Any:
    return oai.chat.completions.create(model=MODEL, **{"temperature": 0, **kw})


def streamed(oai, **kw: Any) -> tuple[str | None, list[dict], list[str | None]]:
    """A streamed chat's content, tool calls (accumulated from their deltas, as clients do)
    and each choice's finish reasons."""
    content, calls, reasons = None, [], []
    for chunk in chat(oai, stream=True, **kw):
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            if c.delta.content:
                content = (content or "") + c.delta.content
            for d in c.delta.tool_calls or []:
                if d.index == len(calls):
                    assert d.id.startswith("call_") and d.type == "function"
                    calls.append({"name": d.function.name, "arguments": ""})
                calls[d.index]["arguments"] += d.function.arguments or ""
    return content, calls, [r for r in reasons if r]


def calls_of(message: Any) -> list[dict]:
    assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls)
    return [{"name": c.function.name, "arguments": c.function.arguments}
            for c in message.tool_calls]


def check_calls(calls: list[dict]) -> None:
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_json_schema_samples_all_validate(oai):
    """50 samples at temperature 1, one request (n=50, so they decode as one batch)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY,
                                                  "strict": True}}
    got = chat(oai, messages=ask("Pick a city and describe its weather as JSON."),
               response_format=fmt, temperature=1.0, n=50, max_tokens=40, seed=3)
    outputs = {c.message.content for c in got.choices}
    for c in got.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), CITY)
    assert len(outputs) > 5  # sampled, not one answer repeated
    done = oai.completions.create(model=MODEL, prompt="A city as JSON:", max_tokens=40,
                                  temperature=0, extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(done.choices[0].text), CITY)


class Forecast(BaseModel):
    city: Literal["Paris", "Rome"]
    rainy: bool


class GetWeather(BaseModel):
    """The current weather in a city."""

    city: str


def test_sdk_parse_helpers(oai):
    """`chat.completions.parse` with a pydantic model (a strict json_schema with its
    `title`s and `$defs`) and a pydantic function tool (strict)."""
    got = oai.chat.completions.parse(model=MODEL, messages=ask("Weather in Rome as JSON."),
                                     response_format=Forecast, max_tokens=30, temperature=0)
    assert isinstance(got.choices[0].message.parsed, Forecast)
    got = oai.chat.completions.parse(model=MODEL, messages=ask("Weather in Rome?"),
                                     tools=[openai.pydantic_function_tool(GetWeather)],
                                     tool_choice="required", max_tokens=30, temperature=0)
    call = got.choices[0].message.tool_calls[0]
    assert call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_json_object(oai):
    got = chat(oai, messages=ask('What country is Paris in? Answer as {"country": ...}.'),
               max_tokens=30, response_format={"type": "json_object"})
    choice = got.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content), dict)


def test_required_calls_plain_and_streamed(oai):
    kw = dict(messages=ask("What is the weather in Paris, and the time in CET?"),
              tools=[WEATHER, TIME], tool_choice="required", max_tokens=60)
    got = chat(oai, **kw)
    message = got.choices[0].message
    assert got.choices[0].finish_reason == "tool_calls"
    assert message.content is None
    calls = calls_of(message)
    check_calls(calls)
    content, streamed_calls, reasons = streamed(oai, **kw)
    assert (content, streamed_calls, reasons) == (None, calls, ["tool_calls"])
    one = chat(oai, **kw, parallel_tool_calls=False).choices[0].message
    assert len(one.tool_calls) == 1
    check_calls(calls_of(one))


def test_named_function_plain_and_streamed(oai):
    kw = dict(messages=ask("Weather in Rome, please."), tools=[WEATHER, TIME], max_tokens=30,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    got = chat(oai, **kw)
    assert got.choices[0].finish_reason == "tool_calls"
    calls = calls_of(got.choices[0].message)
    assert [c["name"] for c in calls] == ["get_weather"]
    check_calls(calls)
    assert streamed(oai, **kw) == (None, calls, ["tool_calls"])


def test_auto_parses_calls_from_text_plain_and_streamed(oai):
    got = chat(oai, messages=TWO_CITIES, tools=[WEATHER], max_tokens=80)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    calls = calls_of(choice.message)
    assert [json.loads(c["arguments"]) for c in calls] == [{"city": "Berlin"}, {"city": "Rome"}]
    assert choice.message.content is None
    assert streamed(oai, messages=TWO_CITIES, tools=[WEATHER], max_tokens=80) == (
        None, calls, ["tool_calls"])
    one = chat(oai, messages=TWO_CITIES, tools=[WEATHER], max_tokens=80,
               parallel_tool_calls=False).choices[0].message
    assert calls_of(one) == calls[:1]
    # tool_choice none: the same text is the answer, nothing parsed
    plain = chat(oai, messages=TWO_CITIES, tools=[WEATHER], max_tokens=80, tool_choice="none")
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason in ("stop", "length")


def test_auto_with_a_strict_tool_constrains_its_calls(oai):
    """A strict tool's calls follow its schema under auto too: here a city must be written
    as a three-letter code, which the model does not do by itself."""
    params = {"type": "object", "required": ["city"],
              "properties": {"city": {"type": "string", "pattern": "^[A-Z]{3}$"}}}
    loose = {"type": "function", "function": {**WEATHER["function"], "parameters": params}}
    strict = {"type": "function", "function": {**loose["function"], "strict": True}}
    free = calls_of(chat(oai, messages=ONE_CITY, tools=[loose], max_tokens=40).choices[0].message)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(free[0]["arguments"]), params)
    got = chat(oai, messages=ONE_CITY, tools=[strict], max_tokens=40).choices[0]
    assert got.finish_reason == "tool_calls", got.message
    jsonschema.validate(json.loads(calls_of(got.message)[0]["arguments"]), params)


def test_tool_loop(oai):
    """call -> the client runs it -> `role: tool` result -> the answer; the second turn
    finds the first one's prompt in the cache."""
    messages = list(ONE_CITY)
    first = chat(oai, messages=messages, tools=[WEATHER], max_tokens=40)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls", message
    call = message.tool_calls[0]
    assert json.loads(call.function.arguments) == {"city": "Berlin"}
    messages += [message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 20 C"}]
    second = chat(oai, messages=messages, tools=[WEATHER], max_tokens=20)
    answer = second.choices[0]
    assert answer.message.tool_calls is None and "Berlin" in answer.message.content, answer
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 32


def test_logit_bias_removes_greedys_token(oai, rpc, tokenizer):
    prompt = "The capital of France is"
    greedy = {"max_new_tokens": 1, "temperature": 0}
    want = rpc.generate(prompt=prompt, sampling_params=greedy)
    plain = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert plain.choices[0].text == want["text"]
    biased = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                    logit_bias={str(want["output_ids"][0]): -100})
    assert biased.choices[0].text != want["text"]
    messages = ask("Say hello.")
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False,
                                                         add_generation_prompt=True))
    want = rpc.generate(input_ids=ids, sampling_params=greedy)
    assert chat(oai, messages=messages, max_tokens=1).choices[0].message.content == want["text"]
    biased = chat(oai, messages=messages, max_tokens=1,
                  logit_bias={str(want["output_ids"][0]): -100})
    assert biased.choices[0].message.content != want["text"]


def test_routine_fields_are_accepted(oai):
    messages = ask("Name a color.")
    plain = chat(oai, messages=messages, max_tokens=5).choices[0].message.content
    routine = chat(oai, messages=messages, max_tokens=5, metadata={"run": "ci"}, store=False,
                   user="u-1", service_tier="auto", safety_identifier="s-1",
                   prompt_cache_key="k", modalities=["text"], reasoning_effort="low",
                   prediction={"type": "content", "content": "Blue"})
    assert routine.choices[0].message.content == plain
    assert oai.completions.create(model="default", prompt="Hi", max_tokens=2, user="u")


@pytest.mark.parametrize("kw, param, words", [
    (dict(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integr"}}}}}),
     "response_format", "properties/a/type"),
    (dict(response_format={"type": "xml"}), "response_format.type", "xml"),
    (dict(response_format={"type": "json_schema", "json_schema": {  # valid, not compilable
        "name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}}),
     "response_format", "response_format: json_schema"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "launch"}}),
     "tool_choice", "'launch'"),
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]),
     "tools[0].function.name", "name"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": "city"}}}]), "tools[0].function.parameters", "required"),
    (dict(tools=[{"type": "custom", "custom": {"name": "f"}}]), "tools[0].type", "custom"),
    (dict(tools=[WEATHER], response_format={"type": "json_object"}), "response_format", "auto"),
    (dict(audio={"voice": "alloy", "format": "wav"}), "audio", "text only"),
    (dict(logit_bias={"999999": -100}), "logit_bias", "vocabulary"),
    (dict(logit_bias={"5": -101}), "logit_bias", "-100"),
    (dict(logit_bias={str(i): 1 for i in range(301)}), "logit_bias", "300"),  # as OpenAI
])
def test_bad_requests_name_the_problem(oai, rpc, kw, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        chat(oai, messages=ask("Hi"), max_tokens=2, **kw)
    error = e.value.body
    assert error["param"] == param and words in error["message"], error
    assert_idle_and_all_free(rpc)
    assert chat(oai, messages=ask("Hi"), max_tokens=2).choices[0].message.content is not None
