"""What every tool-call parser shares: the interface, the deltas it gives out, and reading
one decoded call.

A parser turns a choice's text, as it streams in, into OpenAI's deltas (`{"content"}` or
`{"tool_calls": [...]}`); a plain answer is the same deltas merged (`merge`), so a streamed
choice always adds up to the plain one."""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from typing import Any, ClassVar

Delta = dict[str, Any]

DECODER = json.JSONDecoder()


class ToolCallParser(ABC):
    """One choice's text in, deltas out. `feed` takes the next piece of text and gives the
    deltas it settles; `finish` says the text ended and gives the rest. Any split of the
    text into pieces gives deltas that merge to the same message. `calls` counts the calls
    given out so far (a streamed choice that called finishes with `tool_calls`)."""

    calls: int

    @abstractmethod
    def feed(self, text: str) -> list[Delta]: ...

    @abstractmethod
    def finish(self) -> list[Delta]: ...

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The whole text at once, as a message's `content` and `tool_calls` (`merge`).
        A parser reads one choice: a fresh one per text."""
        return merge(self.feed(text) + self.finish())


class FormatParser(ToolCallParser):
    """A parser of the calls a model writes in free text under `tool_choice` auto, in the
    syntax its chat template asks for (`FORMAT`, the registry's key): the calls of the
    functions in `names`, at most one unless `parallel`."""

    FORMAT: ClassVar[str]
    DESCRIPTION: ClassVar[str]
    """The syntax in words, for error messages."""

    def __init__(self, names: set[str], parallel: bool) -> None:
        self.names, self.parallel = names, parallel
        self.calls = 0


def json_arguments(text: str) -> Any:
    """A call's arguments as templates write them: the JSON value (the text when it is not
    JSON: the model wrote it, and the client sent it back as it was)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def call_delta(index: int, name: str | None, arguments: str) -> Delta:
    """A call's delta: its first names it (with a new id); later ones add arguments."""
    call: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if name is not None:
        call.update(id=f"call_{uuid.uuid4().hex[:24]}", type="function")
        call["function"]["name"] = name
    return {"tool_calls": [call]}


def read_call(value: Any, names: set[str]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a decoded call object, None if it is not one of an
    offered function. `parameters` is read as `arguments` (some models write it so)."""
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or name not in names:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        args = json_arguments(args)
    if not isinstance(args, dict):
        return None
    return name, json.dumps(args, ensure_ascii=False)


class Content:
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


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


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
