"""Tool calling without a server: validation of tools and tool_choice, the prompt (the
template's own tool support, or the Hermes fallback), the constraint schemas, and the
parsers, whose streamed deltas must add up to the plain answer."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import msgspec
import pytest

from radixserve.server.http import tools
from radixserve.server.http.errors import ApiError
from radixserve.server.http.openai_protocol import ChatRequest, chat_messages
from radixserve.server.http.schemas import checked_schema, closed

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
NAMES = {"get_weather", "get_time"}


def request(**kw: Any) -> ChatRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **kw}
    return msgspec.convert(body, ChatRequest)


def streamed(parser: Any, text: str, step: int = 1) -> list[dict]:
    deltas = []
    for i in range(0, len(text), step):
        deltas += parser.feed(text[i:i + step])
    return deltas + parser.finish()


def parsed(make: Any, text: str) -> tuple[str | None, list[dict]]:
    """The plain answer, after checking that every streamed split adds up to it."""
    whole = make()
    content, calls = tools.merge(whole.feed(text) + whole.finish())
    for step in (1, 3, 7):
        got = tools.merge(streamed(make(), text, step))
        assert got[0] == content and _plain(got[1]) == _plain(calls), step
    return content, calls


def _plain(calls: list[dict]) -> list[tuple[str, str]]:
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


class TestHermesParser:
    def make(self, parallel: bool = True) -> tools.HermesParser:
        return tools.HermesParser(NAMES, parallel)

    def test_text_and_parallel_calls(self):
        text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
                '"arguments": {}}\n</tool_call>\n')
        content, calls = parsed(self.make, text)
        assert content == "Let me look."
        assert _plain(calls) == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
        content, calls = parsed(lambda: self.make(parallel=False), text)
        assert _plain(calls) == [("get_weather", '{"city": "Paris"}')]

    def test_only_calls_have_no_content(self):
        content, calls = parsed(self.make, '<tool_call>{"name": "get_time"}</tool_call>')
        assert content is None and _plain(calls) == [("get_time", "{}")]

    def test_what_is_not_a_call_stays_text(self):
        assert parsed(self.make, "No tools needed. 1 < 2.") == ("No tools needed. 1 < 2.", [])
        bad = '<tool_call>{"name": "launch", "arguments": {}}</tool_call>'  # not offered
        assert parsed(self.make, f"A {bad} B") == (f"A {bad} B", [])
        assert parsed(self.make, "<tool_call>not json</tool_call>")[1] == []
        # an end that merely looks like the start of a tag is text after all
        assert parsed(self.make, "See <tool_") == ("See <tool_", [])

    def test_an_unclosed_block_at_the_end_is_read(self):
        content, calls = parsed(self.make, 'Ok <tool_call>\n{"name": "get_weather", '
                                           '"parameters": {"city": "Rome"}}')
        assert content == "Ok" and _plain(calls) == [("get_weather", '{"city": "Rome"}')]

    def test_a_partial_tag_is_held_back_then_text_streams(self):
        p = self.make()
        assert p.feed("Hello <tool") == [{"content": "Hello"}]
        assert p.feed("_call>") == []
        assert p.feed('{"name": "get_time", "arguments": {}}') == []
        out = p.feed("</tool_call>")
        assert out[0]["tool_calls"][0]["function"]["name"] == "get_time"
        assert p.feed(" Done") == [{"content": "  Done"}]  # with the space held after Hello


class TestConstrainedParsers:
    def test_call_array_streams_each_complete_call(self):
        text = ('[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                '{"name": "get_time", "arguments": {}}]')
        make = lambda: tools.CallArrayParser(NAMES, True)  # noqa: E731
        content, calls = parsed(make, text)
        assert content is None
        assert _plain(calls) == [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
        p = make()
        assert p.feed(text[:30]) == []
        assert len(p.feed(text[30:60])) == 1  # the first object closed in here
        one = tools.CallArrayParser(NAMES, False)
        assert _plain(tools.merge(one.feed(text[1:56]) + one.finish())[1]) == [
            ("get_weather", '{"city": "Oslo"}')]

    def test_output_cut_short_keeps_the_rest_as_content(self):
        p = tools.CallArrayParser(NAMES, True)
        content, calls = tools.merge(p.feed('[{"name": "get_time", "arguments": {}}, '
                                            '{"name": "get_wea') + p.finish())
        assert content == '{"name": "get_wea' and len(calls) == 1

    def test_named_function_streams_its_arguments(self):
        p = tools.ArgumentsParser("get_weather")
        first, second = p.feed('{"city": '), p.feed('"Nice"}')
        assert first[0]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                         "arguments": '{"city": '}
        assert "id" not in second[0]["tool_calls"][0]
        assert _plain(tools.merge(first + second + p.finish())[1]) == [
            ("get_weather", '{"city": "Nice"}')]


class TestPlan:
    def test_default_choice_and_none(self):
        assert tools.plan_tools(request()) is None
        assert tools.plan_tools(request(tools=[WEATHER])).mode == "auto"
        assert tools.plan_tools(request(tools=[WEATHER], tool_choice="none")) is None

    def test_named_and_allowed_tools_offer_only_those(self):
        plan = tools.plan_tools(request(tools=[WEATHER, TIME], tool_choice={
            "type": "function", "function": {"name": "get_time"}}))
        assert plan.mode == "named" and [t.function.name for t in plan.tools] == ["get_time"]
        assert plan.constraint() == ("json_schema", tools.NO_ARGUMENTS)
        plan = tools.plan_tools(request(tools=[WEATHER, TIME], tool_choice={
            "type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
                {"type": "function", "function": {"name": "get_weather"}}]}}))
        assert plan.mode == "required" and list(plan.schemas) == ["get_weather"]

    @pytest.mark.parametrize("kw, param, words", [
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
         "tool_choice", "'nope'"),
        (dict(tool_choice="required"), "tool_choice", "no tools"),
        (dict(tools=[WEATHER, WEATHER]), "tools[1].function.name", "twice"),
        (dict(tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "objekt"}}}]),
         "tools[0].function.parameters", "not a valid JSON schema"),
    ])
    def test_bad_tools_name_the_path(self, kw, param, words):
        with pytest.raises(ApiError) as e:
            tools.plan_tools(request(**kw))
        assert e.value.param == param and words in e.value.message

    def test_required_constraint_admits_calls_only(self):
        defs = {"$defs": {"City": {"type": "string", "enum": ["Paris", "Rome"]}}}
        weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}},
            "required": ["city"], **defs}}}
        for parallel, good, bad in (
                (True, [{"name": "get_weather", "arguments": {"city": "Rome"}},
                        {"name": "get_time", "arguments": {}}],
                 [{"name": "get_weather", "arguments": {"city": "Oslo"}}]),
                (False, {"name": "get_time", "arguments": {}}, [])):
            plan = tools.plan_tools(request(tools=[weather, TIME], tool_choice="required",
                                            parallel_tool_calls=parallel))
            kind, schema = plan.constraint()
            assert kind == "json_schema"
            jsonschema.validate(good, schema)
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(bad, schema)

    def test_strict_tools_under_auto_are_tags_the_parser_reads(self):
        strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
        assert tools.plan_tools(request(tools=[WEATHER])).constraint() is None
        kind, tag = tools.plan_tools(request(tools=[strict, TIME],
                                             parallel_tool_calls=False)).constraint()
        assert kind == "structural_tag" and tag["format"]["stop_after_first"] is True
        weather = tag["format"]["tags"][0]
        assert weather["content"]["json_schema"]["additionalProperties"] is False
        text = f'Sure. {weather["begin"]}{{"city": "Oslo"}}{weather["end"]}'
        assert parsed(lambda: tools.HermesParser(NAMES, True), text)[1][0]["function"] == {
            "name": "get_weather", "arguments": '{"city": "Oslo"}'}

    def test_strict_tools_and_schemas_are_closed(self):
        strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
        plan = tools.plan_tools(request(tools=[strict], tool_choice="required"))
        assert plan.schemas["get_weather"]["additionalProperties"] is False
        schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}}},
                  "$defs": {"B": {"properties": {"x": {}}}},
                  "allOf": [{"properties": {"y": {}}}]}
        out = closed(schema)
        assert out["properties"]["a"]["additionalProperties"] is False
        assert out["$defs"]["B"]["additionalProperties"] is False
        assert "additionalProperties" not in out  # composed with allOf: left open
        assert "additionalProperties" not in out["allOf"][0]
        assert checked_schema(schema, "response_format") is schema


class FakeToolTemplate:
    """A tokenizer whose template writes what it is given, tools included."""

    def apply_chat_template(self, messages, tools=None, tokenize=False,
                            add_generation_prompt=True, **kw):
        return json.dumps({"messages": messages, "tools": tools, **kw})


class TestRender:
    HISTORY = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
    ]

    def messages(self, **kw: Any) -> tuple[list[dict], Any]:
        req = request(**{"messages": self.HISTORY, **kw})
        return chat_messages(req), tools.plan_tools(req)

    def test_a_template_without_tools_gets_the_hermes_fallback(self, tokenizer):
        text = tools.render(tokenizer, *self.messages(tools=[WEATHER]))
        system = text.split("<|im_end|>")[0]
        assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
        assert json.dumps(WEATHER) in system and "<tool_call>" in system
        assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Paris"}}\n</tool_call>\n<tool_call>') in text
        assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
                "<tool_response>\nrain\n</tool_response><|im_end|>") in text
        assert text.endswith("<|im_start|>assistant\n")
        # tool_choice none: the history is still written, the tools are not offered
        quiet = tools.render(tokenizer, *self.messages(tools=[WEATHER], tool_choice="none"))
        assert "# Tools" not in quiet and "<tool_response>\nsunny" in quiet

    def test_a_template_with_tools_gets_them_and_the_calls_as_objects(self):
        tools._template_takes_tools.cache_clear()
        # Its own tool format (not Hermes): offered under a constrained tool_choice only.
        out = json.loads(tools.render(FakeToolTemplate(), *self.messages(
            tools=[WEATHER], tool_choice="required")))
        assert out["tools"] == [WEATHER]
        call = out["messages"][2]["tool_calls"][0]
        assert call["function"]["arguments"] == {"city": "Paris"}
        assert out["messages"][3] == {"role": "tool", "content": "sunny",
                                      "tool_call_id": "call_1"}

    def test_a_template_with_its_own_tool_format_is_refused_under_auto(self, tokenizer):
        """Mistral's template writes tools as [AVAILABLE_TOOLS] and its model answers with
        [TOOL_CALLS], which the Hermes parser cannot read: auto is a 400, a constrained
        choice still runs; a template that asks for <tool_call> (Qwen2.5, Qwen3) runs."""
        mistral, qwen = MistralLikeTemplate(), QwenLikeTemplate()
        with pytest.raises(ApiError, match=r"own format \(Mistral's \[TOOL_CALLS\]\)") as e:
            tools.render(mistral, *self.messages(tools=[WEATHER]))
        assert e.value.param == "tool_choice"
        assert "[AVAILABLE_TOOLS]" in tools.render(mistral, *self.messages(
            tools=[WEATHER], tool_choice="required"))
        assert "get_weather" in tools.render(qwen, *self.messages(tools=[WEATHER]))


class MistralLikeTemplate:
    chat_template = "{{ '[AVAILABLE_TOOLS]' }}...[TOOL_CALLS]"

    def apply_chat_template(self, messages, tools=None, tokenize=False,
                            add_generation_prompt=True, **kw):
        listed = f"[AVAILABLE_TOOLS]{json.dumps(tools)}[/AVAILABLE_TOOLS]" if tools else ""
        return listed + "".join(f"[INST]{m.get('content')}[/INST]" for m in messages)


class QwenLikeTemplate(MistralLikeTemplate):
    chat_template = "... <tool_call> ..."

    def apply_chat_template(self, messages, tools=None, tokenize=False,
                            add_generation_prompt=True, **kw):
        listed = (f"<tools>{json.dumps(tools)}</tools> answer in <tool_call></tool_call>"
                  if tools else "")
        return listed + "".join(f"<|im_start|>{m.get('content')}" for m in messages)
