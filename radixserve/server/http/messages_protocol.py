"""Anthropic's Messages API: the request shapes (`POST /v1/messages`,
`/v1/messages/count_tokens`), their reading into the shared pieces (content blocks into a
`Conversation`, tools and `tool_choice` into a `ToolPlan`'s input), the answer's shape and
Anthropic's error shape. No I/O here: the routes are `messages_api`.

Refused by name: image and document blocks (radixserve serves text-only models), extended
thinking, server tools (any tool with a `type` but `custom`), MCP servers and containers."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from radixserve.chat.conversation import Conversation, not_text, text_of
from radixserve.chat.tool_calls.base import json_arguments
from radixserve.chat.tool_types import (FunctionChoice, FunctionDef, NamedToolChoice,
                                        ToolChoice, ToolDef)
from radixserve.server.http import openai_protocol as proto
from radixserve.server.http.errors import ApiError
from radixserve.server.http.turns import Block

MAX_TOOLS = 128
MAX_STOP_SEQUENCES = 16
ID = Annotated[str, Meta(max_length=128)]


class Inner(Struct):
    """A block inside a tool_result's content (text; anything else is refused)."""

    type: str
    text: str | None = None


class ContentBlock(Struct, kw_only=True):
    """A content block: text, tool_use (assistant) or tool_result (user). Unknown keys
    (cache_control, citations) are ignored: clients send back the blocks they got."""

    type: str
    text: str | None = None
    id: ID | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: ID | None = None
    content: str | Annotated[list[Inner], Meta(max_length=proto.MAX_CHAT_PARTS)] | None = None
    is_error: bool | None = None


class MessageParam(Struct, forbid_unknown_fields=True):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[ContentBlock], Meta(max_length=proto.MAX_CHAT_PARTS)]


class SystemBlock(Struct):
    type: str
    text: str | None = None


Messages = Annotated[list[MessageParam], Meta(max_length=proto.MAX_CHAT_MESSAGES)]
System = str | Annotated[list[SystemBlock], Meta(max_length=proto.MAX_CHAT_PARTS)]
Tools = Annotated[list[dict[str, Any]], Meta(max_length=MAX_TOOLS)]


class CountTokensRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
    messages: Messages
    system: System | None = None
    tools: Tools | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    """Refused unless disabled: radixserve runs no extended thinking."""


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: Annotated[int, Meta(ge=1)]
    stop_sequences: Annotated[list[str], Meta(max_length=MAX_STOP_SEQUENCES)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    """No effect (Anthropic's `user_id`, for its abuse detection)."""
    stream: bool = False
    # -- accepted, no effect: one tier, one place, prompts cached without being asked --
    service_tier: str | None = None
    speed: str | None = None
    inference_geo: str | None = None
    cache_control: dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    output_config: dict[str, Any] | None = None
    """Its `effort` steers Anthropic's models (no effect); a `format` is refused."""
    # -- refused by name --
    container: Any = None
    mcp_servers: Any = None


def check(req: CountTokensRequest) -> None:
    if req.thinking is not None and req.thinking.get("type") != "disabled":
        raise ApiError(400, "thinking is not supported: radixserve runs no extended thinking",
                       param="thinking")
    if isinstance(req, MessagesRequest) and (req.output_config or {}).get("format"):
        raise ApiError(400, "output_config.format is not supported: use a tool with "
                       "tool_choice tool for JSON output", param="output_config.format")
    for name in ("container", "mcp_servers"):
        if getattr(req, name, None) is not None:
            raise ApiError(400, f"{name} is not supported: radixserve runs no server tools",
                           param=name)
    if not req.messages:
        raise ApiError(400, "messages must not be empty", param="messages")


def conversation(req: CountTokensRequest) -> list[dict[str, Any]]:
    """The system prompt and messages as chat-template messages (`chat.conversation`)."""
    talk = Conversation(proto.MAX_CHAT_MESSAGES + 1)
    if isinstance(req.system, str) and req.system:
        talk.say("system", req.system, "system")
    elif isinstance(req.system, list) and req.system:
        talk.say("system", text_of([(b.type, b.text) for b in req.system], ("text",),
                                   "system"), "system")
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if isinstance(m.content, str):
            talk.say(m.role, m.content, where)
            continue
        text: list[str] = []
        for k, b in enumerate(m.content):
            at = f"{where}.content[{k}]"
            if b.type == "text":
                text.append(b.text or "")
                continue
            if text:  # the text before a call or result is its own turn
                talk.say(m.role, "".join(text), where)
                text = []
            if b.type == "tool_use" and m.role == "assistant":
                if b.id is None or b.name is None:
                    raise ApiError(400, f"{at}: a tool_use block needs id and name", param=at)
                talk.call(b.id, b.name, json.dumps(b.input or {}, ensure_ascii=False), at)
            elif b.type == "tool_result" and m.role == "user":
                if b.tool_use_id is None:
                    raise ApiError(400, f"{at}: a tool_result block needs tool_use_id",
                                   param=at)
                result = b.content if isinstance(b.content, str) or b.content is None else (
                    text_of([(p.type, p.text) for p in b.content], ("text",), f"{at}.content"))
                talk.result(b.tool_use_id, result or "", at)
            elif b.type in ("tool_use", "tool_result"):
                raise ApiError(400, f"{at}: a {b.type} block belongs in a"
                               f"{'n assistant' if b.type == 'tool_use' else ' user'} message",
                               param=at)
            else:
                raise not_text(b.type, at)
        if text or not m.content:
            talk.say(m.role, "".join(text), where)
    return talk.messages


def tools(req: CountTokensRequest) -> list[ToolDef] | None:
    """Custom tools as chat's `ToolDef`s; server tools are refused by their type."""
    if req.tools is None:
        return None
    out = []
    for i, tool in enumerate(req.tools):
        kind = tool.get("type", "custom")
        if kind != "custom":
            raise ApiError(400, f"tools[{i}]: tools of type {kind!r} are not supported: "
                           "radixserve runs no server tools; declare custom tools (name, "
                           "description, input_schema)", param=f"tools[{i}].type")
        fields = {"name": tool.get("name"), "description": tool.get("description"),
                  "parameters": tool.get("input_schema")}
        unknown = set(tool) - {"type", "name", "description", "input_schema", "cache_control"}
        if unknown:
            raise ApiError(400, f"tools[{i}]: unknown field {sorted(unknown)[0]!r}",
                           param=f"tools[{i}]")
        try:
            out.append(ToolDef("function", msgspec.convert(fields, FunctionDef)))
        except msgspec.ValidationError as e:
            raise ApiError(400, f"tools[{i}]: {e}", param=f"tools[{i}]") from None
    return out


def tool_choice(req: CountTokensRequest) -> tuple[ToolChoice | None, bool]:
    """`tool_choice` in chat's terms, and whether calls may be parallel."""
    choice = req.tool_choice
    if choice is None:
        return None, True
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return NamedToolChoice(FunctionChoice(choice["name"])), parallel
    raise ApiError(400, "tool_choice must be {\"type\": \"auto\"}, \"any\", \"none\" or "
                   "{\"type\": \"tool\", \"name\": ...}", param="tool_choice")


def content(blocks: list[Block]) -> list[dict[str, Any]]:
    """An answer's blocks as Anthropic's content blocks."""
    return [{"type": "text", "text": b.text} if b.kind == "text" else
            {"type": "tool_use", "id": b.call_id, "name": b.name, "input": call_input(b.text)}
            for b in blocks]


def call_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as its `input` object ({} when they are not one: an answer cut
    short by max_tokens, which its stop_reason says)."""
    value = json_arguments(arguments)
    return value if isinstance(value, dict) else {}


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


class AnthropicError(ApiError):
    """An error in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`."""

    def body(self) -> dict[str, Any]:
        kind = ERROR_TYPES.get(self.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    @classmethod
    def of(cls, e: Any) -> AnthropicError:
        """An ApiError or ChatError (status, message, param) in this shape."""
        return cls(e.status, e.message, param=e.param, code=e.code)
