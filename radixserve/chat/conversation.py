"""One conversion of a conversation into the chat template's messages, shared by the three
APIs that hold one: Chat Completions' messages, the Responses API's items and the Messages
API's content blocks all say the same four things (a turn of text, an assistant's tool call,
a tool's result, a part that is not text), and each API only reads its own spelling of them
into a `Conversation`. What the template then gets is `prompt.render`'s input: OpenAI's chat
shape, `{"role", "content"}` with an assistant's `tool_calls` and a tool result's
`tool_call_id`."""

from __future__ import annotations

from typing import Any

from radixserve.chat.errors import ChatError

class Conversation:
    """The chat template's messages, built in order. Each method names where in the
    caller's request its input came from (`param`), so a refusal names the bad field."""

    def __init__(self, max_messages: int) -> None:
        self.messages: list[dict[str, Any]] = []
        self.max_messages = max_messages

    def say(self, role: str, text: str, param: str, name: str | None = None) -> None:
        """A turn of text; OpenAI's `developer` is the template's `system`. The role is the
        caller's API's to check: a template may know more (Llama 3's `ipython`)."""
        message: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                   "content": text}
        if name is not None:
            message["name"] = name
        self._add(message, param)

    def call(self, call_id: str, name: str, arguments: str, param: str) -> None:
        """An assistant's tool call, `arguments` as JSON text. It joins the assistant turn
        just before it (its text, or its other calls): the template writes one turn."""
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": ""}
            self._add(last, param)
        last.setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function", "function": {"name": name,
                                                             "arguments": arguments}})

    def result(self, call_id: str, text: str, param: str, name: str | None = None) -> None:
        """A tool's result for the call `call_id` (of the function `name`, where said)."""
        message = {"role": "tool", "tool_call_id": call_id, "content": text}
        if name is not None:
            message["name"] = name
        self._add(message, param)

    def extend(self, messages: list[dict[str, Any]], param: str) -> None:
        """Messages already converted (a stored conversation), copied: a call that joins
        the last of them must not change the stored one."""
        if len(self.messages) + len(messages) > self.max_messages:
            self._too_long(param)
        self.messages += [{**m, "tool_calls": list(m["tool_calls"])} if "tool_calls" in m
                          else dict(m) for m in messages]

    def _add(self, message: dict[str, Any], param: str) -> None:
        if len(self.messages) >= self.max_messages:
            self._too_long(param)
        self.messages.append(message)

    def _too_long(self, param: str) -> None:
        raise ChatError(400, f"{param}: the conversation holds more than "
                        f"{self.max_messages} messages", param=param)


def not_text(kind: str, param: str) -> ChatError:
    """The refusal of a content part (or block, or item) that is not text, by its name."""
    return ChatError(400, f"{param}: content of type {kind!r} is not supported: radixserve "
                     "serves text-only models (text parts, tool calls and tool results)",
                     param=param)


def text_of(parts: list[tuple[str, str | None]], text_kinds: tuple[str, ...],
            param: str) -> str:
    """The text of a turn's `(type, text)` parts, joined; a part of any kind but
    `text_kinds` is refused by name."""
    for i, (kind, _) in enumerate(parts):
        if kind not in text_kinds:
            raise not_text(kind, f"{param}[{i}]")
    return "".join(text or "" for _, text in parts)
