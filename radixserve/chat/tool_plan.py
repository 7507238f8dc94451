"""Tool calling's plan for one chat request: which tools the model is offered, what
`tool_choice` constrains its output to, and which parser reads the calls back.

Output, per `tool_choice` (default `auto` when tools are given, as OpenAI's):
- `none`: no tools offered, nothing parsed.
- `auto`: free generation, read in the tool-call syntax the model's own chat template asks
  for (`tool_format`, from the template's text; `tool_calls.registry`, one parser each):
  Hermes (each `<tool_call>` block holding a JSON call of an offered function becomes a
  tool call; Qwen2.5, Qwen3, and the fallback), Mistral (`[TOOL_CALLS]` then a JSON array
  of calls, or `[TOOL_CALLS]name[ARGS]{...}`) or Llama 3.1/3.2 (an answer opening with
  `{"name", "parameters"}` objects separated by `;`, or after `<|python_tag|>`); the text
  around the calls is the content. When a tool is `strict` (OpenAI's promise: its calls follow its
  schema), each call, once the model writes `<tool_call>`, is constrained to the Hermes
  syntax and its function's arguments schema (a structural tag, as SGLang does for strict
  tools); the text stays free. Strict tools under auto are Hermes-only: a Llama 3 call opens
  with no trigger a tag could wait for (a bare `{` at the start), and a Mistral array holds
  every call after one trigger, which a tag per call does not write; for those models it is a
  400 that points to `required` or a named function.
- `required`: the output is constrained (a JSON schema) to an array of one or more
  `{"name", "arguments"}` objects, each a call of an offered function, as SGLang does it.
- a named function: the output is constrained to that function's arguments.
- `allowed_tools`: only the listed tools are offered, under its mode (auto or required).
With `parallel_tool_calls: false` there is at most one call: `required` is constrained to one
object rather than an array, and under `auto` the calls after the first are dropped (with a
strict tool, not generated).

The prompt is `prompt.render`'s; the parsers are in `tool_calls`."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from radixserve.chat.errors import ChatError
from radixserve.chat.schemas import checked_schema
from radixserve.chat.tool_calls.base import ToolCallParser
from radixserve.chat.tool_calls.constrained import ArgumentsParser, CallArrayParser
from radixserve.chat.tool_calls.hermes import CLOSE, OPEN
from radixserve.chat.tool_calls.registry import FORMATS, PARSERS
from radixserve.chat.tool_format import tool_format
from radixserve.chat.tool_types import NO_ARGUMENTS, NamedToolChoice, ToolChoice, ToolDef


@dataclass(frozen=True)
class ToolPlan:
    """A request's validated tool settings."""

    tools: list[ToolDef]
    """The tools offered to the model, whose calls are read back."""
    mode: Literal["auto", "required", "named"]
    parallel: bool
    schemas: dict[str, dict[str, Any]]
    """Each offered function's arguments schema (checked; closed when the tool is strict)."""
    strict: bool
    """Some offered tool is strict: under auto, calls are constrained too."""
    format: str = "hermes"
    """The tool-call syntax read back under auto (a key of `registry.PARSERS`), the chat
    template's own."""

    @property
    def keeps_special_tokens(self) -> bool:
        """The calls are read in a format whose markers are special tokens (Mistral's
        `[TOOL_CALLS]`, Llama 3's `<|python_tag|>`), which the text must keep."""
        return self.mode == "auto" and self.format != "hermes"

    def offered(self) -> list[dict[str, Any]]:
        """The tools as chat templates take them (OpenAI's shape, unset fields left out)."""
        return [{"type": "function", "function": {k: v for k, v in msgspec.to_builtins(
            t.function).items() if v is not None}} for t in self.tools]

    def constraint(self) -> tuple[str, dict[str, Any]] | None:
        """What the output is constrained to, as (sampling parameter, value): a JSON schema
        for required and named, a structural tag for auto with strict tools, else none."""
        if self.mode == "auto":
            return self._strict_tags() if self.strict else None
        if self.mode == "named":
            return "json_schema", self.schemas[self.tools[0].function.name]
        calls = [{"type": "object", "additionalProperties": False,
                  "required": ["name", "arguments"],
                  "properties": {"name": {"type": "string", "enum": [name]},
                                 "arguments": schema}}
                 for name, schema in self.schemas.items()]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {"type": "array", "minItems": 1, "items": one} if self.parallel else dict(one)
        # Arguments schemas nest here, so their `#/$defs/...` refs must find the root's.
        for key in ("$defs", "definitions"):
            merged: dict[str, Any] = {}
            for sub in self.schemas.values():
                for def_name, definition in (sub.get(key) or {}).items():
                    if merged.setdefault(def_name, definition) != definition:
                        raise ChatError(400, f"tools: two functions define {key} "
                                        f"{def_name!r} differently, so tool_choice required "
                                        "cannot constrain them together", param="tools")
            if merged:
                schema[key] = merged
        return "json_schema", schema

    def _strict_tags(self) -> tuple[str, dict[str, Any]]:
        """Free text, but from each `<tool_call>` on, a call written as the Hermes parser
        reads it with arguments that follow their schema (xgrammar's triggered tags)."""
        tags = [{"type": "tag", "begin": f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": ',
                 "content": {"type": "json_schema", "json_schema": schema},
                 "end": f"}}\n{CLOSE}"} for name, schema in self.schemas.items()]
        return "structural_tag", {"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": [OPEN], "tags": tags,
            "stop_after_first": not self.parallel}}

    def parser(self) -> ToolCallParser:
        """A fresh parser of one choice's text: the format's under auto, else the
        constrained output's."""
        if self.mode == "auto":
            return PARSERS[self.format](set(self.schemas), self.parallel)
        if self.mode == "named":
            return ArgumentsParser(self.tools[0].function.name)
        return CallArrayParser(set(self.schemas), self.parallel)


def plan_tools(tools: list[ToolDef] | None, tool_choice: ToolChoice | None,
               parallel_tool_calls: bool, tokenizer: Any = None) -> ToolPlan | None:
    """Validate a chat request's `tools`, `tool_choice` and `parallel_tool_calls` (400s name
    the path, such as `tools[0].function.parameters`); None when no tool is offered. Under
    auto, the calls are read in the syntax of `tokenizer`'s chat template (`tool_format`;
    Hermes without one)."""
    plan = _plan(tools or [], tool_choice, parallel_tool_calls)
    if plan is None or plan.mode != "auto" or tokenizer is None:
        return plan
    fmt = tool_format(tokenizer)
    if fmt not in PARSERS:
        raise ChatError(400, f"this model's chat template offers tools in its own format "
                        f"({fmt}), whose calls radixserve cannot read back under "
                        f"tool_choice auto (it reads {', '.join(FORMATS.values())}); pass "
                        "tool_choice required or a named function, whose output is "
                        "constrained JSON", param="tool_choice")
    if plan.strict and fmt != "hermes":
        raise ChatError(400, f"strict tools under tool_choice auto are constrained as Hermes "
                        f"<tool_call> blocks, but this model writes {FORMATS[fmt]}; pass "
                        "tool_choice required or a named function (constrained to the "
                        "schemas), or drop strict", param="tools")
    return dataclasses.replace(plan, format=fmt)


def _plan(tools: list[ToolDef], tool_choice: ToolChoice | None, parallel: bool
          ) -> ToolPlan | None:
    schemas: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        f = tool.function
        if f.name in schemas:
            raise ChatError(400, f"tools[{i}].function.name: {f.name!r} is declared twice",
                            param=f"tools[{i}].function.name")
        schemas[f.name] = NO_ARGUMENTS if f.parameters is None else checked_schema(
            f.parameters, f"tools[{i}].function.parameters", strict=bool(f.strict))
    choice = tool_choice if tool_choice is not None else "auto"
    if choice == "none" or (choice == "auto" and not tools):
        return None
    if not tools:
        raise ChatError(400, "tool_choice asks for a tool call, but no tools are given",
                        param="tool_choice")
    if choice == "auto" or choice == "required":
        return ToolPlan(tools, choice, parallel, schemas, _strict(tools))
    if isinstance(choice, NamedToolChoice):
        mode: Literal["auto", "required", "named"] = "named"
        names = [choice.function.name]
    else:
        mode, names = choice.allowed_tools.mode, [
            t.function.name for t in choice.allowed_tools.tools]
        if not names:
            raise ChatError(400, "tool_choice.allowed_tools.tools names no tool",
                            param="tool_choice")
    for name in names:
        if name not in schemas:
            raise ChatError(400, f"tool_choice names the function {name!r}, which is not in "
                            f"tools ({', '.join(schemas)})", param="tool_choice")
    offered = [t for t in tools if t.function.name in names]
    return ToolPlan(offered, mode, parallel,
                    {t.function.name: schemas[t.function.name] for t in offered},
                    _strict(offered))


def _strict(tools: list[ToolDef]) -> bool:
    return any(t.function.strict for t in tools)

