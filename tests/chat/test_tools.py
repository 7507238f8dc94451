"""Tool calling without a server: validation of tools and tool_choice, the prompt (the
template's own tool support, or the Hermes fallback), the constraint schemas, and the
parsers, whose streamed deltas must add up to the plain answer."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import msgspec
import pytest

from radixserve.chat import prompt, tool_plan
from radixserve.chat.errors import ChatError
from radixserve.chat.schemas import checked_schema, closed
from radixserve.chat.tool_calls.base import merge
from radixserve.chat.tool_calls.constrained import ArgumentsParser, CallArrayParser
from radixserve.chat.tool_calls.hermes import HermesParser
from radixserve.chat.tool_calls.llama3 import Llama3Parser
from radixserve.chat.tool_calls.mistral import MistralParser
from radixserve.chat.tool_format import template_takes_tools, tool_format
from radixserve.chat.tool_types import NO_ARGUMENTS
from radixserve.server.http.openai_protocol import ChatRequest, chat_messages

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
NAMES = {"get_weather", "get_time"}


def request(**kw: Any) -> ChatRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **kw}
    return msgspec.convert(body, ChatRequest)


def plan_tools(req: ChatRequest, tokenizer: Any = None) -> tool_plan.ToolPlan | None:
    return tool_plan.plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, tokenizer)


def streamed(parser: Any, text: str, step: int = 1) -> list[dict]:
    deltas = []
    for i in range(0, len(text), step):
        deltas += parser.feed(text[i:i + step])
    return deltas + parser.finish()


def parsed(make: Any, text: str) -> tuple[str | None, list[dict]]:
    """The plain answer, after checking that every streamed split adds up to it."""
    content, calls = make().parse(text)
    for step in (1, 3, 7):
        got = merge(streamed(make(), text, step))
        assert got[0] == content and _plain(got[1]) == _plain(calls), step
    return content, calls


def _plain(calls: list[dict]) -> list[tuple[str, str]]:
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


class TestHermesParser:
    def make(self, parallel: bool = True) -> HermesParser:
        return HermesParser(NAMES, parallel)

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
        make = lambda: CallArrayParser(NAMES, True)  # noqa: E731
        content, calls = parsed(make, text)
        assert content is None
        assert _plain(calls) == [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
        p = make()
        assert p.feed(text[:30]) == []
        assert len(p.feed(text[30:60])) == 1  # the first object closed in here
        one = CallArrayParser(NAMES, False)
        assert _plain(merge(one.feed(text[1:56]) + one.finish())[1]) == [
            ("get_weather", '{"city": "Oslo"}')]

    def test_output_cut_short_keeps_the_rest_as_content(self):
        p = CallArrayParser(NAMES, True)
        content, calls = merge(p.feed('[{"name": "get_time", "arguments": {}}, '
                                            '{"name": "get_wea') + p.finish())
        assert content == '{"name": "get_wea' and len(calls) == 1

    def test_named_function_streams_its_arguments(self):
        p = ArgumentsParser("get_weather")
        first, second = p.feed('{"city": '), p.feed('"Nice"}')
        assert first[0]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                         "arguments": '{"city": '}
        assert "id" not in second[0]["tool_calls"][0]
        assert _plain(merge(first + second + p.finish())[1]) == [
            ("get_weather", '{"city": "Nice"}')]


class TestPlan:
    def test_default_choice_and_none(self):
        assert plan_tools(request()) is None
        assert plan_tools(request(tools=[WEATHER])).mode == "auto"
        assert plan_tools(request(tools=[WEATHER], tool_choice="none")) is None

    def test_named_and_allowed_tools_offer_only_those(self):
        plan = plan_tools(request(tools=[WEATHER, TIME], tool_choice={
            "type": "function", "function": {"name": "get_time"}}))
        assert plan.mode == "named" and [t.function.name for t in plan.tools] == ["get_time"]
        assert plan.constraint() == ("json_schema", NO_ARGUMENTS)
        plan = plan_tools(request(tools=[WEATHER, TIME], tool_choice={
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
        with pytest.raises(ChatError) as e:
            plan_tools(request(**kw))
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
            plan = plan_tools(request(tools=[weather, TIME], tool_choice="required",
                                            parallel_tool_calls=parallel))
            kind, schema = plan.constraint()
            assert kind == "json_schema"
            jsonschema.validate(good, schema)
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(bad, schema)

    def test_strict_tools_under_auto_are_tags_the_parser_reads(self):
        strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
        assert plan_tools(request(tools=[WEATHER])).constraint() is None
        kind, tag = plan_tools(request(tools=[strict, TIME],
                                             parallel_tool_calls=False)).constraint()
        assert kind == "structural_tag" and tag["format"]["stop_after_first"] is True
        weather = tag["format"]["tags"][0]
        assert weather["content"]["json_schema"]["additionalProperties"] is False
        text = f'Sure. {weather["begin"]}{{"city": "Oslo"}}{weather["end"]}'
        assert parsed(lambda: HermesParser(NAMES, True), text)[1][0]["function"] == {
            "name": "get_weather", "arguments": '{"city": "Oslo"}'}

    def test_strict_tools_and_schemas_are_closed(self):
        strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
        plan = plan_tools(request(tools=[strict], tool_choice="required"))
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
        return chat_messages(req), plan_tools(req)

    def test_a_template_without_tools_gets_the_hermes_fallback(self, tokenizer):
        text = prompt.render(tokenizer, *self.messages(tools=[WEATHER]))
        system = text.split("<|im_end|>")[0]
        assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
        assert json.dumps(WEATHER) in system and "<tool_call>" in system
        assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Paris"}}\n</tool_call>\n<tool_call>') in text
        assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
                "<tool_response>\nrain\n</tool_response><|im_end|>") in text
        assert text.endswith("<|im_start|>assistant\n")
        # tool_choice none: the history is still written, the tools are not offered
        quiet = prompt.render(tokenizer, *self.messages(tools=[WEATHER], tool_choice="none"))
        assert "# Tools" not in quiet and "<tool_response>\nsunny" in quiet

    def test_a_template_with_tools_gets_them_and_the_calls_as_objects(self):
        template_takes_tools.cache_clear()
        # Its own tool format (not Hermes): offered under a constrained tool_choice only.
        out = json.loads(prompt.render(FakeToolTemplate(), *self.messages(
            tools=[WEATHER], tool_choice="required")))
        assert out["tools"] == [WEATHER]
        call = out["messages"][2]["tool_calls"][0]
        assert call["function"]["arguments"] == {"city": "Paris"}
        assert out["messages"][3] == {"role": "tool", "content": "sunny",
                                      "tool_call_id": "call_1"}

    def test_a_template_with_an_unknown_tool_format_is_refused_under_auto(self):
        """A template that takes tools but asks for none of the formats a parser reads
        (Hermes, Mistral, Llama 3): auto is a 400, a constrained choice still runs."""
        template_takes_tools.cache_clear()
        fake = FakeToolTemplate()
        assert tool_format(fake) == "not Hermes <tool_call>"
        with pytest.raises(ChatError, match=r"own format \(not Hermes <tool_call>\)") as e:
            plan_tools(request(tools=[WEATHER]), fake)
        assert e.value.param == "tool_choice"
        assert plan_tools(request(tools=[WEATHER], tool_choice="required"), fake)

    def test_the_format_follows_the_template(self, tokenizer):
        mistral, qwen = MistralLikeTemplate(), QwenLikeTemplate()
        assert tool_format(tokenizer) == "hermes"  # SmolLM2: the Hermes fallback
        assert tool_format(qwen) == "hermes"
        assert tool_format(mistral) == "mistral"
        assert tool_format(JinjaTemplate(MISTRAL_V03)) == "mistral"
        assert tool_format(JinjaTemplate(LLAMA_31)) == "llama3"
        req = request(messages=self.HISTORY, tools=[WEATHER])
        plan = plan_tools(req, mistral)
        assert plan.format == "mistral" and plan.keeps_special_tokens
        assert isinstance(plan.parser(), MistralParser)
        assert "[AVAILABLE_TOOLS]" in prompt.render(mistral, chat_messages(req), plan)
        with pytest.raises(ChatError, match="read as hermes"):  # a plan for another model
            prompt.render(mistral, chat_messages(req), plan_tools(req))
        plan = plan_tools(req, qwen)
        assert plan.format == "hermes" and not plan.keeps_special_tokens
        assert "get_weather" in prompt.render(qwen, chat_messages(req), plan)
        # required and named stay constrained JSON, whatever the template
        plan = plan_tools(request(tools=[WEATHER], tool_choice="required"), mistral)
        assert plan.format == "hermes" and isinstance(plan.parser(), CallArrayParser)

    def test_strict_under_auto_is_hermes_only(self):
        strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
        for template in (MistralLikeTemplate(), JinjaTemplate(LLAMA_31)):
            with pytest.raises(ChatError, match="strict tools under tool_choice auto") as e:
                plan_tools(request(tools=[strict]), template)
            assert e.value.param == "tools"
            plan = plan_tools(request(tools=[strict], tool_choice="required"), template)
            assert plan.constraint()[0] == "json_schema"
        kind, _ = plan_tools(request(tools=[strict]), QwenLikeTemplate()).constraint()
        assert kind == "structural_tag"


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


class JinjaTemplate:
    """A tokenizer whose chat template is real template text, rendered as transformers does
    (a sandbox, `tojson` without HTML escaping, `raise_exception`)."""

    def __init__(self, chat_template: str) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False,
                                                                  indent=indent)
        env.globals["raise_exception"] = raise_exception
        self.chat_template = chat_template
        self.compiled = env.from_string(chat_template)

    def apply_chat_template(self, messages, tools=None, tokenize=False,
                            add_generation_prompt=True, **kw):
        return self.compiled.render(messages=messages, tools=tools, bos_token="<s>",
                                    eos_token="</s>",
                                    add_generation_prompt=add_generation_prompt, **kw)


# mistralai/Mistral-7B-Instruct-v0.3's tokenizer_config.json chat_template (whole).
MISTRAL_V03 = """\
{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

# meta-llama/Llama-3.1-8B-Instruct's chat_template, its tool sections (the builtin-tool
# `.call(...)` rendering of earlier calls left out: radixserve offers no builtin tools).
LLAMA_31 = """\
{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(...)" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""


def split_parsed(make: Any, text: str) -> tuple[str | None, list[dict]]:
    """`parsed`, also fed in uneven chunks (every split point once, and 2-5-char pieces)."""
    content, calls = parsed(make, text)
    for step in (2, 5, 11):
        got = merge(streamed(make(), text, step))
        assert got[0] == content and _plain(got[1]) == _plain(calls), step
    for cut in range(len(text) + 1):
        p = make()
        got = merge(p.feed(text[:cut]) + p.feed(text[cut:]) + p.finish())
        assert got[0] == content and _plain(got[1]) == _plain(calls), cut
    return content, calls


class TestMistral:
    """Mistral v0.3's template and its model's `[TOOL_CALLS] [...]` answers."""

    def make(self, parallel: bool = True) -> MistralParser:
        return MistralParser(NAMES, parallel)

    def test_render_offers_the_tools_and_writes_the_history(self):
        template = JinjaTemplate(MISTRAL_V03)
        req = request(messages=TestRender.HISTORY, tools=[WEATHER])
        plan = plan_tools(req, template)
        assert plan.format == "mistral" and plan.constraint() is None
        text = prompt.render(template, chat_messages(req), plan)
        assert text.startswith('<s>[AVAILABLE_TOOLS] [{"type": "function", "function": '
                               '{"name": "get_weather", ')  # before the last user turn
        assert ('[/AVAILABLE_TOOLS][INST] Weather in Paris and Rome?[/INST][TOOL_CALLS] ['
                in text)
        ids = [prompt.mistral_call_id("call_1"), prompt.mistral_call_id("call_2")]
        assert all(len(i) == 9 and i.isalnum() for i in ids) and ids[0] != ids[1]
        assert (f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {{"city": "Paris"}}, '
                f'"id": "{ids[0]}"}}, {{"name": "get_weather", "arguments": {{"city": '
                f'"Rome"}}, "id": "{ids[1]}"}}]</s>') in text
        assert (f'[TOOL_RESULTS] {{"content": sunny, "call_id": "{ids[0]}"}}[/TOOL_RESULTS]'
                f'[TOOL_RESULTS] {{"content": rain, "call_id": "{ids[1]}"}}[/TOOL_RESULTS]'
                ) in text
        req = request(messages=[{"role": "user", "content": "Hi"}], tools=[WEATHER, TIME])
        text = prompt.render(template, chat_messages(req), plan_tools(req, template))
        assert text == ('<s>[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": '
                        '"get_weather", "description": "The weather in a city.", '
                        '"parameters": ' + json.dumps(WEATHER["function"]["parameters"])
                        + '}}, {"type": "function", "function": {"name": "get_time"}}]'
                        '[/AVAILABLE_TOOLS][INST] Hi[/INST]')

    def test_parallel_calls(self):
        text = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {}}]')
        content, calls = split_parsed(self.make, text)
        assert content is None
        assert _plain(calls) == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
        content, calls = split_parsed(lambda: self.make(parallel=False), text)
        assert content is None and _plain(calls) == [("get_weather", '{"city": "Paris"}')]

    def test_text_around_calls_and_a_bare_object(self):
        text = ('Let me check. [TOOL_CALLS] {"name": "get_time", "arguments": {}} then '
                'more')
        content, calls = split_parsed(self.make, text)
        assert content == "Let me check. then more" and _plain(calls) == [("get_time", "{}")]

    def test_the_newer_name_args_form(self):
        text = ('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
                '[TOOL_CALLS]get_time[ARGS]{}')
        content, calls = split_parsed(self.make, text)
        assert content is None
        assert _plain(calls) == [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
        assert _plain(split_parsed(lambda: self.make(False), text)[1]) == [
            ("get_weather", '{"city": "Oslo"}')]

    def test_what_is_not_a_call_stays_text(self):
        assert split_parsed(self.make, "No tools. [1, 2] [TOOL") == (
            "No tools. [1, 2] [TOOL", [])
        unknown = '[TOOL_CALLS] [{"name": "launch", "arguments": {}}]'
        assert split_parsed(self.make, f"A {unknown} B") == (f"A {unknown} B", [])
        bad = '[TOOL_CALLS] [{"name": "get_time", "arguments": {}'  # never completes
        assert split_parsed(self.make, bad) == (bad, [])
        assert split_parsed(self.make, "[TOOL_CALLS]not a call") == (
            "[TOOL_CALLS]not a call", [])
        # an unknown call after a good one ends the calls; it stays text
        content, calls = split_parsed(self.make, (
            '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}, '
            '{"name": "launch", "arguments": {}}]'))
        assert content == '{"name": "launch", "arguments": {}}]'
        assert _plain(calls) == [("get_time", "{}")]

    def test_a_partial_trigger_is_held_back_then_text_streams(self):
        p = self.make()
        assert p.feed("Hello [TOOL") == [{"content": "Hello"}]
        assert p.feed("_CALLS] [") == []
        assert p.feed('{"name": "get_time", "arguments": {}') == []
        out = p.feed("}")
        assert out[0]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
        assert p.feed("]") + p.finish() == []


class TestLlama3:
    """Llama 3.1's template and its model's `{"name", "parameters"}` answers."""

    def make(self, parallel: bool = True) -> Llama3Parser:
        return Llama3Parser(NAMES, parallel)

    def test_render_offers_the_tools_and_writes_the_history(self):
        template = JinjaTemplate(LLAMA_31)
        history = [*TestRender.HISTORY[:2], {**TestRender.HISTORY[2], "tool_calls": [
            TestRender.HISTORY[2]["tool_calls"][0]]}, TestRender.HISTORY[3]]
        req = request(messages=history, tools=[WEATHER])
        plan = plan_tools(req, template)
        assert plan.format == "llama3" and plan.keeps_special_tokens
        text = prompt.render(template, chat_messages(req), plan)
        assert text.startswith("<s><|start_header_id|>system<|end_header_id|>\n\n"
                               "Environment: ipython\n")
        assert ('Respond in the format {"name": function name, "parameters": dictionary of '
                'argument name and its value}.') in text
        assert json.dumps(WEATHER, indent=4) in text
        assert ('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", '
                '"parameters": {"city": "Paris"}}<|eot_id|>') in text
        assert '<|start_header_id|>ipython<|end_header_id|>\n\n"sunny"<|eot_id|>' in text
        assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")

    def test_calls_separated_by_semicolons(self):
        text = ('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                '{"name": "get_time", "parameters": {}}')
        content, calls = split_parsed(self.make, text)
        assert content is None
        assert _plain(calls) == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
        assert _plain(split_parsed(lambda: self.make(False), text)[1]) == [
            ("get_weather", '{"city": "Paris"}')]

    def test_after_the_python_tag(self):
        text = '<|python_tag|>{"name": "get_time", "parameters": {}}'
        assert _plain(split_parsed(self.make, text)[1]) == [("get_time", "{}")]
        text = 'Checking. <|python_tag|>{"name": "get_time", "arguments": {}}'
        content, calls = split_parsed(self.make, text)
        assert content == "Checking." and _plain(calls) == [("get_time", "{}")]

    def test_what_is_not_a_call_stays_text(self):
        plain = 'The call would be {"name": "get_time", "parameters": {}}.'
        assert split_parsed(self.make, plain) == (plain, [])  # JSON later on is text
        unknown = '{"name": "launch", "parameters": {}}'
        assert split_parsed(self.make, unknown) == (unknown, [])
        assert split_parsed(self.make, '{"name": "get_time", "parameters": ') == (
            '{"name": "get_time", "parameters":', [])  # never completes
        assert split_parsed(self.make, "{not json} at all") == ("{not json} at all", [])
        content, calls = split_parsed(self.make, '{"name": "get_time", "parameters": {}} ok')
        assert content == "ok" and _plain(calls) == [("get_time", "{}")]

    def test_the_start_is_held_back_until_it_tells(self):
        p = self.make()
        assert p.feed("  ") == [] and p.feed("<|py") == []
        assert p.feed("thon") == []
        assert p.feed(" is a language") == [{"content": "<|python is a language"}]
        p = self.make()
        assert p.feed(' {"name": "get_time", ') == []
        out = p.feed('"parameters": {}}')
        assert out[0]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
