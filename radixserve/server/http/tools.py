"""Tool calling on /v1/chat/completions: which tools the model is offered and how, what
`tool_choice` constrains its output to, and the calls read back out of its text.

Prompt. The tools go to the model's chat template (`apply_chat_template(tools=...)`), and
so do assistant turns with `tool_calls` and `tool` results. A template that ignores tools
(probed once per tokenizer; SmolLM2's has no tool support) gets them the Hermes way, as
Qwen2.5's template writes them: a `# Tools` section in the system prompt lists the functions
inside `<tools></tools>` and asks for `<tool_call>{"name": ..., "arguments": ...}</tool_call>`;
earlier calls are written in that syntax in their assistant turns, and results go back in a
user turn as `<tool_response>...</tool_response>`. (SGLang and vLLM leave such a template
alone, so the model never hears of the tools.)

Output, per `tool_choice` (default `auto` when tools are given, as OpenAI's):
- `none`: no tools offered, nothing parsed.
- `auto`: free generation, read in the tool-call syntax the model's own chat template asks
  for (`tool_format`, from the template's text; `FORMATS`, one parser each): Hermes (each
  `<tool_call>` block holding a JSON call of an offered function becomes a tool call; Qwen2.5,
  Qwen3, and the fallback), Mistral (`[TOOL_CALLS]` then a JSON array of calls, or
  `[TOOL_CALLS]name[ARGS]{...}`) or Llama 3.1/3.2 (an answer opening with `{"name",
  "parameters"}` objects separated by `;`, or after `<|python_tag|>`); the text around the
  calls is the content. When a tool is `strict` (OpenAI's promise: its calls follow its
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

Each parser turns a choice's text, as it streams in, into OpenAI's deltas (`{"content"}` or
`{"tool_calls": [...]}`); a plain answer is the same deltas merged (`merge`), so a streamed
choice always adds up to the plain one."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import uuid
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import msgspec

from radixserve.server.http.errors import ApiError
from radixserve.server.http.openai_protocol import ChatRequest, NamedToolChoice, ToolDef
from radixserve.server.http.schemas import checked_schema

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}
"""The arguments schema of a function declared without `parameters`."""

Delta = dict[str, Any]


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
    """The tool-call syntax read back under auto (`FORMATS`), the chat template's own."""

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
            for name, sub in self.schemas.items():
                for def_name, definition in (sub.get(key) or {}).items():
                    if merged.setdefault(def_name, definition) != definition:
                        raise ApiError(400, f"tools: two functions define {key} "
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

    def parser(self) -> (HermesParser | MistralParser | Llama3Parser | CallArrayParser
                         | ArgumentsParser):
        if self.mode == "auto":
            return PARSERS[self.format](set(self.schemas), self.parallel)
        if self.mode == "named":
            return ArgumentsParser(self.tools[0].function.name)
        return CallArrayParser(set(self.schemas), self.parallel)


def plan_tools(req: ChatRequest, tokenizer: Any = None) -> ToolPlan | None:
    """Validate `tools`, `tool_choice` and `parallel_tool_calls` (400s name the path, such
    as `tools[0].function.parameters`); None when no tool is offered. Under auto, the calls
    are read in the syntax of `tokenizer`'s chat template (`tool_format`; Hermes without
    one)."""
    plan = _plan(req)
    if plan is None or plan.mode != "auto" or tokenizer is None:
        return plan
    fmt = tool_format(tokenizer)
    if fmt not in PARSERS:
        raise ApiError(400, f"this model's chat template offers tools in its own format "
                       f"({fmt}), whose calls radixserve cannot read back under "
                       f"tool_choice auto (it reads {', '.join(FORMATS.values())}); pass "
                       "tool_choice required or a named function, whose output is "
                       "constrained JSON", param="tool_choice")
    if plan.strict and fmt != "hermes":
        raise ApiError(400, f"strict tools under tool_choice auto are constrained as Hermes "
                       f"<tool_call> blocks, but this model writes {FORMATS[fmt]}; pass "
                       "tool_choice required or a named function (constrained to the "
                       "schemas), or drop strict", param="tools")
    return dataclasses.replace(plan, format=fmt)


def _plan(req: ChatRequest) -> ToolPlan | None:
    tools = req.tools or []
    schemas: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        f = tool.function
        if f.name in schemas:
            raise ApiError(400, f"tools[{i}].function.name: {f.name!r} is declared twice",
                           param=f"tools[{i}].function.name")
        schemas[f.name] = NO_ARGUMENTS if f.parameters is None else checked_schema(
            f.parameters, f"tools[{i}].function.parameters", strict=bool(f.strict))
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    if choice == "none" or (choice == "auto" and not tools):
        return None
    if not tools:
        raise ApiError(400, "tool_choice asks for a tool call, but no tools are given",
                       param="tool_choice")
    if choice == "auto" or choice == "required":
        return ToolPlan(tools, choice, req.parallel_tool_calls, schemas, _strict(tools))
    if isinstance(choice, NamedToolChoice):
        mode: Literal["auto", "required", "named"] = "named"
        names = [choice.function.name]
    else:
        mode, names = choice.allowed_tools.mode, [
            t.function.name for t in choice.allowed_tools.tools]
        if not names:
            raise ApiError(400, "tool_choice.allowed_tools.tools names no tool",
                           param="tool_choice")
    for name in names:
        if name not in schemas:
            raise ApiError(400, f"tool_choice names the function {name!r}, which is not in "
                           f"tools ({', '.join(schemas)})", param="tool_choice")
    offered = [t for t in tools if t.function.name in names]
    return ToolPlan(offered, mode, req.parallel_tool_calls,
                    {t.function.name: schemas[t.function.name] for t in offered},
                    _strict(offered))


def _strict(tools: list[ToolDef]) -> bool:
    return any(t.function.strict for t in tools)


# -- the prompt -------------------------------------------------------------------------

def render(tokenizer: Any, messages: list[dict[str, Any]], plan: ToolPlan | None,
           **template_kwargs: Any) -> str:
    """The prompt text: `messages` (as `openai_protocol.chat_messages` gives them) and the
    plan's tools through the chat template, or its Hermes fallback."""
    tools = plan.offered() if plan is not None else None
    if _template_takes_tools(tokenizer):
        fmt = _template_tool_format(tokenizer)
        if plan is not None and plan.mode == "auto" and plan.format != fmt:
            raise ApiError(500, f"this model's chat template writes tool calls as {fmt}, but "
                           f"the calls would be read as {plan.format} (plan_tools was not "
                           "given this tokenizer)", param="tool_choice")
        messages = [_for_template(m) for m in messages]
        if fmt == "mistral":
            messages = [_mistral_ids(m) for m in messages]
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True,
            **template_kwargs)
    return tokenizer.apply_chat_template(_hermes(messages, tools), tokenize=False,
                                         add_generation_prompt=True, **template_kwargs)


_PROBE = [{"role": "user", "content": "Hi"}]
_PROBE_TOOL = {"type": "function", "function": {"name": "probe", "description": "A probe.",
                                                "parameters": NO_ARGUMENTS}}


@lru_cache(maxsize=8)
def _template_takes_tools(tokenizer: Any) -> bool:
    """Whether the chat template writes tools it is given: rendered with one and without."""
    try:
        plain = tokenizer.apply_chat_template(_PROBE, tokenize=False,
                                              add_generation_prompt=True)
        offered = tokenizer.apply_chat_template(_PROBE, tools=[_PROBE_TOOL], tokenize=False,
                                                add_generation_prompt=True)
    except Exception:  # a template that breaks on the probe is not one to trust with tools
        return False
    return offered != plain


FORMATS = {"hermes": "Hermes <tool_call> blocks", "mistral": "Mistral's [TOOL_CALLS]",
           "llama3": "Llama 3's JSON calls"}
"""The tool-call syntaxes read back under auto, each by its parser (`PARSERS`)."""

_OWN_FORMATS = {"[TOOL_CALLS]": "mistral", "[AVAILABLE_TOOLS]": "mistral",
                "<|python_tag|>": "llama3",
                '"parameters": dictionary of argument name and its value': "llama3"}
"""What marks a template's own format, in what it writes or in its source, in this order."""


def tool_format(tokenizer: Any) -> str:
    """The syntax `tokenizer`'s model writes tool calls in: `hermes` when its template
    ignores tools (they get the Hermes fallback), else `_template_tool_format`'s answer."""
    return _template_tool_format(tokenizer) if _template_takes_tools(tokenizer) else "hermes"


@lru_cache(maxsize=8)
def _template_tool_format(tokenizer: Any) -> str:
    """The tool-call format a template that takes tools asks for, read from what it writes
    for a probe tool and from its source: `hermes` when it asks for `<tool_call>` blocks
    (Qwen2.5, Qwen3, Hermes models), `mistral` for `[TOOL_CALLS]` (Mistral v0.3 and later),
    `llama3` for Llama 3.1/3.2's JSON calls, else a description of a format no parser reads.
    The one place that decides."""
    offered = tokenizer.apply_chat_template(_PROBE, tools=[_PROBE_TOOL], tokenize=False,
                                            add_generation_prompt=True)
    if OPEN in offered:
        return "hermes"
    source = getattr(tokenizer, "chat_template", None)
    text = offered + (source if isinstance(source, str) else "")
    for marker, name in _OWN_FORMATS.items():
        if marker in text:
            return name
    return "not Hermes <tool_call>"


_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def _mistral_id(call_id: Any) -> Any:
    """Mistral's templates take 9 alphanumeric characters as a call id (and raise on any
    other): OpenAI's ids map to one, the same for a call and its result."""
    if not isinstance(call_id, str) or _MISTRAL_ID.fullmatch(call_id):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _mistral_ids(message: dict[str, Any]) -> dict[str, Any]:
    if "tool_call_id" in message:
        message = {**message, "tool_call_id": _mistral_id(message["tool_call_id"])}
    if message.get("tool_calls"):
        message = {**message, "tool_calls": [{**c, "id": _mistral_id(c.get("id"))}
                                             for c in message["tool_calls"]]}
    return message


def _arguments(text: str) -> Any:
    """A call's arguments as templates write them: the JSON value (the text when it is not
    JSON: the model wrote it, and the client sent it back as it was)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    """Templates `tojson` a call's arguments, so they take the object, not OpenAI's text."""
    if "tool_calls" not in message:
        return message
    calls = [{**c, "function": {**c["function"],
                                "arguments": _arguments(c["function"]["arguments"])}}
             for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def _call_text(function: dict[str, Any]) -> str:
    call = {"name": function["name"], "arguments": _arguments(function["arguments"])}
    return f"{OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{CLOSE}"


def _tools_section(tools: list[dict[str, Any]]) -> str:
    """Qwen2.5's wording, which Hermes-trained models know."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            f"within {OPEN}{CLOSE} XML tags:\n"
            f'{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}')


def _hermes(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
            ) -> list[dict[str, Any]]:
    """Messages any template renders: calls as `<tool_call>` text in their assistant turn,
    results (consecutive ones together) as `<tool_response>` text in a user turn, and the
    tools section at the end of the system prompt (or as the system prompt, in place of
    whatever default the template would write)."""
    out: list[dict[str, Any]] = []
    previous = None
    for m in messages:
        if m["role"] == "tool":
            response = f"<tool_response>\n{m['content']}\n</tool_response>"
            if previous == "tool":
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
        elif m.get("tool_calls"):
            calls = "\n".join(_call_text(c["function"]) for c in m["tool_calls"])
            out.append({"role": m["role"],
                        "content": f"{m['content']}\n{calls}" if m["content"] else calls})
        else:
            out.append(m)
        previous = m["role"]
    if tools:
        section = _tools_section(tools)
        if out and out[0]["role"] == "system":
            system = out[0]["content"]
            out[0] = {**out[0], "content": f"{system}\n\n{section}" if system else section}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


# -- the output -------------------------------------------------------------------------

def _call_delta(index: int, name: str | None, arguments: str) -> Delta:
    """A call's delta: its first names it (with a new id); later ones add arguments."""
    call: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if name is not None:
        call.update(id=f"call_{uuid.uuid4().hex[:24]}", type="function")
        call["function"]["name"] = name
    return {"tool_calls": [call]}


def _read_call(value: Any, names: set[str]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a decoded call object, None if it is not one of an
    offered function. `parameters` is read as `arguments` (some models write it so)."""
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or name not in names:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        args = _arguments(args)
    if not isinstance(args, dict):
        return None
    return name, json.dumps(args, ensure_ascii=False)


class _Content:
    """Content deltas with the whitespace at both ends of the whole content left out (what
    separates calls, or trails them), holding a trailing run back until text follows it."""

    def __init__(self) -> None:
        self.started = False
        self.pending = ""

    def add(self, text: str) -> list[Delta]:
        if not self.started:
            text = text.lstrip()
            self.started = bool(text)
        text = self.pending + text
        body = text.rstrip()
        self.pending = text[len(body):]
        return [{"content": body}] if body else []


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class HermesParser:
    """`auto`: `<tool_call>{json}</tool_call>` blocks out of free text. Text before a
    block streams as content at once, except an end that may be the start of `<tool_call>`;
    a block goes out as one call delta once it is closed (or the output ends inside it). A
    block that does not hold a call of an offered function stays content, as written."""

    def __init__(self, names: set[str], parallel: bool) -> None:
        self.names, self.parallel = names, parallel
        self.calls = 0
        self.buffer = ""
        """Text not yet given out: an open block, or what may begin one."""
        self.in_block = False
        self.content = _Content()

    def feed(self, text: str) -> list[Delta]:
        self.buffer += text
        out: list[Delta] = []
        while True:
            if not self.in_block:
                at = self.buffer.find(OPEN)
                if at < 0:
                    keep = len(self.buffer) - _partial_suffix(self.buffer, OPEN)
                    out += self.content.add(self.buffer[:keep])
                    self.buffer = self.buffer[keep:]
                    return out
                out += self.content.add(self.buffer[:at])
                self.buffer, self.in_block = self.buffer[at:], True
            end = self.buffer.find(CLOSE)
            if end < 0:
                return out
            end += len(CLOSE)
            out += self._block(self.buffer[:end], self.buffer[len(OPEN):end - len(CLOSE)])
            self.buffer, self.in_block = self.buffer[end:], False

    def finish(self) -> list[Delta]:
        """The output ended: an open block is read as it stands, the rest is content."""
        rest, self.buffer = self.buffer, ""
        if self.in_block:
            return self._block(rest, rest[len(OPEN):])
        return self.content.add(rest)

    def _block(self, raw: str, inner: str) -> list[Delta]:
        call = _read_call(_arguments(inner.strip()), self.names)
        if call is None:
            return self.content.add(raw)
        if self.calls and not self.parallel:
            return []  # parallel_tool_calls: false allows one call
        self.calls += 1
        return [_call_delta(self.calls - 1, *call)]


_DECODER = json.JSONDecoder()

_WAIT = None
"""`_JsonCalls._step`: the text so far cannot tell yet."""


class _JsonCalls:
    """Calls written as JSON objects after a trigger (`TRIGGER`) in free text, the base of
    the Mistral and Llama 3 parsers. Text outside a block of calls streams as content, except
    an end that may be the start of the trigger; in a block, each call goes out as one call
    delta once its object is complete. The first thing in a block that is not a call of an
    offered function (another name, not an object, JSON that never completes) ends the block
    and stays content as written, with the trigger when no call was read before it; the text
    after it is free text again. With `parallel_tool_calls: false` the calls after the first
    are dropped. A subclass reads the block (`_step`)."""

    TRIGGER = ""
    AT_START = False
    """A bare `{` opening the output starts a block too (Llama 3 writes no trigger)."""

    def __init__(self, names: set[str], parallel: bool) -> None:
        self.names, self.parallel = names, parallel
        self.calls = 0
        self.buffer = ""
        """Text not yet given out: the block being read, or what may begin one."""
        self.in_block = False
        self.state = ""
        """Where the subclass is in the block."""
        self.head = ""
        """The block's text read so far while no call was read in it (content if it fails)."""
        self.read_call = False
        self.started = not self.AT_START
        self.content = _Content()

    def feed(self, text: str) -> list[Delta]:
        self.buffer += text
        return self._run(final=False)

    def finish(self) -> list[Delta]:
        """The output ended: what the block holds is read as it stands, the rest is
        content."""
        out = self._run(final=True)
        rest, self.buffer = self.buffer, ""
        return out + self.content.add(rest)

    def _run(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while True:
            if not self.in_block:
                if not self._open(final, out):
                    return out
                continue
            gap = len(self.buffer) - len(self.buffer.lstrip())
            step = self._step(self.buffer[gap:], final)
            if step is _WAIT:
                if final:  # nothing more will come: what is left is no call
                    self._fail(len(self.buffer), out)
                return out
            kind, used, value = step
            used += gap
            if kind == "call":
                call = _read_call(value, self.names)
                if call is None:
                    self._fail(used, out)
                    continue
                if self.calls == 0 or self.parallel:
                    out.append(_call_delta(self.calls, *call))
                    self.calls += 1
                self.read_call = True
            elif kind == "bad":
                self._fail(used, out)
                continue
            elif not self.read_call:
                self.head += self.buffer[:used]
            self.buffer = self.buffer[used:]
            if kind == "end":
                self.in_block = False

    def _open(self, final: bool, out: list[Delta]) -> bool:
        """Out of a block: give out the content before the next one, and open it (True), or
        hold back what may still begin one (False)."""
        if not self.started:
            body = self.buffer.lstrip()
            if body.startswith("{"):
                self.started = True
                return self._enter(len(self.buffer) - len(body), 0, out)
            if not final and (not body or self.TRIGGER.startswith(body)):
                return False
            self.started = True
        at = self.buffer.find(self.TRIGGER)
        if at < 0:
            keep = len(self.buffer) - (0 if final else
                                       _partial_suffix(self.buffer, self.TRIGGER))
            out += self.content.add(self.buffer[:keep])
            self.buffer = self.buffer[keep:]
            return False
        return self._enter(at, len(self.TRIGGER), out)

    def _enter(self, at: int, trigger: int, out: list[Delta]) -> bool:
        out += self.content.add(self.buffer[:at])
        self.head, self.buffer = self.buffer[at:at + trigger], self.buffer[at + trigger:]
        self.in_block, self.read_call, self.state = True, False, "start"
        return True

    def _fail(self, used: int, out: list[Delta]) -> None:
        """The block ends in what is not a call: its first `used` characters (with the block's
        head when no call was read) are content."""
        raw = ("" if self.read_call else self.head) + self.buffer[:used]
        out += self.content.add(raw)
        self.buffer, self.in_block = self.buffer[used:], False

    def _step(self, text: str, final: bool) -> tuple[str, int, Any] | None:
        """What begins `text` (the block's rest, whitespace skipped): ("call", length,
        object), ("sep", length, None) for what goes between calls, ("end", length, None)
        where the block ends, ("bad", length, None), or `_WAIT`."""
        raise NotImplementedError

    def _then(self, state: str, step: tuple[str, int, Any] | None
              ) -> tuple[str, int, Any] | None:
        """`step`, moving to `state` unless it waits."""
        if step is not _WAIT:
            self.state = state
        return step

    @staticmethod
    def _object(text: str) -> tuple[str, int, Any] | None:
        """A JSON object opening `text`, once it is complete."""
        if not text:
            return _WAIT
        if text[0] != "{":
            return "bad", 0, None
        try:
            value, end = _DECODER.raw_decode(text)
        except ValueError:
            return _WAIT  # not complete yet (or never: then the end of the output tells)
        return "call", end, value


_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
ARGS = "[ARGS]"


class MistralParser(_JsonCalls):
    """`auto` for Mistral's templates (v3 tokenizers on: Mistral-7B-Instruct-v0.3, Nemo,
    Small): `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` objects, or one bare
    object, or the newer form (Mistral Small 3.2, Magistral, Devstral) of `name[ARGS]{...}`
    after each `[TOOL_CALLS]`. The trigger is a special token: the server keeps special
    tokens in the text of such a request (`keeps_special_tokens`)."""

    TRIGGER = "[TOOL_CALLS]"

    def _step(self, text: str, final: bool) -> tuple[str, int, Any] | None:
        if not text:
            if self.state in ("after", "named"):
                return ("end", 0, None) if final else _WAIT
            return _WAIT
        if self.state == "start":
            if text[0] == "[":
                self.state = "item"
                return "sep", 1, None
            if text[0] == "{":  # one bare object: the block ends after it
                return self._then("named", self._object(text))
            name = _NAME.match(text)
            if name is None:
                return "bad", 0, None
            rest = text[name.end():]
            if rest.startswith(ARGS):
                step = self._object(rest[len(ARGS):].lstrip())
                if step is _WAIT or step[0] != "call":
                    return step if step is _WAIT else ("bad", len(text) - len(rest), None)
                gap = len(rest) - len(ARGS) - len(rest[len(ARGS):].lstrip())
                self.state = "named"
                return "call", len(text) - len(rest) + len(ARGS) + gap + step[1], {
                    "name": name.group(), "arguments": step[2]}
            return _WAIT if ARGS.startswith(rest) and not final else ("bad", 0, None)
        if self.state == "named":
            return "end", 0, None
        if self.state == "item":
            return self._then("after", self._object(text))
        # after an object in the array
        if text[0] == ",":
            self.state = "item"
            return "sep", 1, None
        if text[0] == "]":
            return "end", 1, None
        return "end", 0, None


class Llama3Parser(_JsonCalls):
    """`auto` for Llama 3.1/3.2's templates: the answer is a call when it opens with a JSON
    object `{"name": ..., "parameters": {...}}` (or one after `<|python_tag|>`, a special
    token the server keeps in the text of such a request), possibly several separated by
    `;`. A JSON object later in the text, not after the tag, is text."""

    TRIGGER = "<|python_tag|>"
    AT_START = True

    def _step(self, text: str, final: bool) -> tuple[str, int, Any] | None:
        if self.state == "after":
            if not text:
                return ("end", 0, None) if final else _WAIT
            if text[0] == ";":
                self.state = "start"
                return "sep", 1, None
            return "end", 0, None
        return self._then("after", self._object(text)) if text else _WAIT


PARSERS = {"hermes": HermesParser, "mistral": MistralParser, "llama3": Llama3Parser}


class CallArrayParser:
    """`required`: a JSON array of `{"name", "arguments"}` objects (one object when not
    parallel), as the constraint makes the model write it; each call goes out as soon as
    its object is complete. What cannot be read as calls (output cut short) is content."""

    def __init__(self, names: set[str], parallel: bool) -> None:
        self.names, self.parallel = names, parallel
        self.calls = 0
        self.buffer = ""
        self.read = 0
        """Characters of `buffer` taken as calls (and the brackets and commas between)."""
        self.opened = not parallel
        self.closed = False

    def feed(self, text: str) -> list[Delta]:
        self.buffer += text
        out: list[Delta] = []
        while not self.closed:
            at = len(self.buffer) - len(self.buffer[self.read:].lstrip())
            if at == len(self.buffer):
                break
            char = self.buffer[at]
            if not self.opened or (self.parallel and (char == "]" or char == ",")):
                if not self.opened and char != "[":
                    break
                self.opened, self.closed, self.read = True, char == "]", at + 1
                continue
            try:
                value, end = _DECODER.raw_decode(self.buffer, at)
            except ValueError:
                break  # not complete yet
            call = _read_call(value, self.names)
            if call is None:
                break
            out.append(_call_delta(self.calls, *call))
            self.calls += 1
            self.read, self.closed = end, not self.parallel
        return out

    def finish(self) -> list[Delta]:
        if self.closed:
            return []
        rest = (self.buffer[self.read:] if self.calls else self.buffer).strip()
        return [{"content": rest}] if rest else []


class ArgumentsParser:
    """A named function: the whole output is its arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = 0

    def feed(self, text: str) -> list[Delta]:
        if not text:
            return []
        named = self.name if self.calls == 0 else None
        self.calls = 1
        return [_call_delta(0, named, text)]

    def finish(self) -> list[Delta]:
        if self.calls:
            return []
        self.calls = 1
        return [_call_delta(0, self.name, "")]  # nothing was generated: an empty call


def merge(deltas: list[Delta]) -> tuple[str | None, list[dict[str, Any]]]:
    """A choice's deltas as a message's `content` (None when it only calls) and
    `tool_calls`."""
    content = "".join(d.get("content", "") for d in deltas)
    calls: list[dict[str, Any]] = []
    for d in deltas:
        for c in d.get("tool_calls", ()):
            if c["index"] == len(calls):
                calls.append({"id": c["id"], "type": "function",
                              "function": {"name": c["function"]["name"], "arguments": ""}})
            calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
    return (content or None) if calls else content, calls
