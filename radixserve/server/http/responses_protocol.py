"""The Responses API's request shape (`POST /v1/responses`) and its reading into the shared
pieces: items into a `Conversation`, tools and `tool_choice` into a `ToolPlan`'s input,
`text.format` into a response format. No I/O here: the route is `responses_api`.

Every field the `openai` client's `responses.create` and the Agents SDK send is declared:
supported, accepted without effect (OpenAI's bookkeeping, prompt-cache hints), or refused
by name (`REFUSED`). Hosted tools and any content but text are refused by name too."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from radixserve.chat.conversation import Conversation, text_of
from radixserve.chat.tool_types import (AllowedTools, AllowedToolsChoice, FunctionChoice,
                                        FunctionDef, NamedToolChoice, ToolChoice, ToolDef)
from radixserve.server.http import openai_protocol as proto
from radixserve.server.http.errors import ApiError

MAX_INPUT_ITEMS = proto.MAX_CHAT_MESSAGES
"""Items one request may hold (a huge list is refused as it is decoded)."""
MAX_TOOLS = 128
MAX_METADATA = 16
"""OpenAI's limit on metadata pairs."""
ID = Annotated[str, Meta(max_length=128)]
TEXT_KINDS = ("input_text", "output_text", "text")


class Part(Struct):
    """A content part; unknown keys (annotations, logprobs) are ignored, as clients send
    back the output items they got."""

    type: str
    text: str | None = None


Content = str | Annotated[list[Part], Meta(max_length=proto.MAX_CHAT_PARTS)]


class Item(Struct, kw_only=True):
    """An input item: a message (whose `type` may be left out), a `function_call` or a
    `function_call_output`. Unknown keys (an output item's `id`, `status`) are ignored."""

    type: str = "message"
    role: str | None = None
    content: Content | None = None
    call_id: ID | None = None
    name: str | None = None
    arguments: str | None = None
    output: Content | None = None


class TextConfig(Struct, forbid_unknown_fields=True):
    format: dict[str, Any] | None = None
    verbosity: str | None = None
    """No effect: it steers OpenAI's models."""


class ResponsesRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
    input: str | Annotated[list[Item], Meta(max_length=MAX_INPUT_ITEMS)] = ""
    instructions: str | None = None
    tools: Annotated[list[dict[str, Any]], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: Annotated[dict[str, str], Meta(max_length=MAX_METADATA)] | None = None
    store: bool = True
    previous_response_id: ID | None = None
    stream: bool = False
    # -- accepted, no effect: bookkeeping, hints, what only reasoning models read --
    stream_options: dict[str, Any] | None = None
    include: Annotated[list[str], Meta(max_length=32)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    # -- refused by name (see REFUSED) --
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    top_logprobs: int | None = None
    context_management: Any = None


REFUSED = {
    "conversation": "use previous_response_id (radixserve has no Conversations API)",
    "background": "responses run while their request is open",
    "prompt": "radixserve has no stored prompt templates",
    "top_logprobs": "use /v1/chat/completions for logprobs",
    "context_management": "radixserve does not compact conversations",
}


def check(req: ResponsesRequest) -> None:
    for name, why in REFUSED.items():
        if getattr(req, name) not in (None, False):
            raise ApiError(400, f"{name} is not supported: {why}", param=name)
    if not req.input and req.previous_response_id is None:
        raise ApiError(400, "input must not be empty", param="input")


def read_input(req: ResponsesRequest, talk: Conversation) -> None:
    """`req.input` into `talk` (after what a previous response held)."""
    if isinstance(req.input, str):
        talk.say("user", req.input, "input")
        return
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if item.type == "message":
            if item.role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"{where}.role must be user, assistant, system or "
                               f"developer, got {item.role!r}", param=f"{where}.role")
            talk.say(item.role, _text(item.content, f"{where}.content"), where)
        elif item.type == "function_call":
            if item.call_id is None or item.name is None or item.arguments is None:
                raise ApiError(400, f"{where}: a function_call needs call_id, name and "
                               "arguments", param=where)
            talk.call(item.call_id, item.name, item.arguments, where)
        elif item.type == "function_call_output":
            if item.call_id is None or item.output is None:
                raise ApiError(400, f"{where}: a function_call_output needs call_id and "
                               "output", param=where)
            talk.result(item.call_id, _text(item.output, f"{where}.output"), where)
        else:
            raise ApiError(400, f"{where}: input items of type {item.type!r} are not "
                           "supported (message, function_call and function_call_output are)",
                           param=f"{where}.type")


def _text(content: Content | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return text_of([(p.type, p.text) for p in content], TEXT_KINDS, param)


def tools(req: ResponsesRequest) -> list[ToolDef] | None:
    """The function tools, as chat's `ToolDef`s; a hosted tool is refused by its type."""
    if req.tools is None:
        return None
    out = []
    for i, tool in enumerate(req.tools):
        kind = tool.get("type")
        if kind != "function":
            raise ApiError(400, f"tools[{i}]: tools of type {kind!r} are not supported: "
                           "radixserve runs no hosted tools (web search, file search, code "
                           "interpreter, ...); declare function tools", param=f"tools[{i}].type")
        fields = {k: v for k, v in tool.items() if k != "type"}
        try:
            out.append(ToolDef("function", msgspec.convert(fields, FunctionDef)))
        except msgspec.ValidationError as e:
            raise ApiError(400, f"tools[{i}]: {e}", param=f"tools[{i}]") from None
    return out


def tool_choice(req: ResponsesRequest) -> ToolChoice | None:
    """`tool_choice` in chat's terms: a string, a function by `name` (flat, not chat's
    nested `function`), or allowed tools."""
    choice = req.tool_choice
    if choice is None or choice in ("none", "auto", "required"):
        return choice  # type: ignore[return-value]
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
            choice.get("name"), str):
        return NamedToolChoice(FunctionChoice(choice["name"]))
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools" and choice.get(
            "mode") in ("auto", "required") and isinstance(choice.get("tools"), list):
        names = [t.get("name") if isinstance(t, dict) else None for t in choice["tools"]]
        if all(isinstance(n, str) for n in names):
            return AllowedToolsChoice(AllowedTools(choice["mode"], [
                NamedToolChoice(FunctionChoice(str(n))) for n in names]))
    raise ApiError(400, "tool_choice must be none, auto, required, {\"type\": \"function\", "
                   "\"name\": ...} or allowed_tools of function tools (hosted tools are not "
                   "supported)", param="tool_choice")


def response_format(req: ResponsesRequest) -> proto.ResponseFormat | None:
    """`text.format` as chat's `response_format` (its json_schema fields are flat here)."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None:
        return None
    kind = fmt.get("type")
    body: dict[str, Any] = {"type": kind}
    if kind == "json_schema":
        body["json_schema"] = {k: v for k, v in fmt.items() if k != "type"}
    elif len(fmt) > 1:
        body = {**fmt}
    try:
        return msgspec.convert(body, proto.ResponseFormat)
    except msgspec.ValidationError as e:
        raise ApiError(400, f"text.format: {e}", param="text.format") from None

