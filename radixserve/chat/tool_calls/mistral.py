"""Mistral tool calls: `[TOOL_CALLS]` then a JSON array of calls (or one object), or the
newer `[TOOL_CALLS]name[ARGS]{...}`."""

from __future__ import annotations

import re
from typing import Any

from radixserve.chat.tool_calls.json_calls import WAIT, JsonCalls

_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
ARGS = "[ARGS]"


class MistralParser(JsonCalls):
    """`auto` for Mistral's templates (v3 tokenizers on: Mistral-7B-Instruct-v0.3, Nemo,
    Small): `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` objects, or one bare
    object, or the newer form (Mistral Small 3.2, Magistral, Devstral) of `name[ARGS]{...}`
    after each `[TOOL_CALLS]`. The trigger is a special token: the server keeps special
    tokens in the text of such a request (`keeps_special_tokens`)."""

    FORMAT = "mistral"
    DESCRIPTION = "Mistral's [TOOL_CALLS]"
    TRIGGER = "[TOOL_CALLS]"

    def _step(self, text: str, final: bool) -> tuple[str, int, Any] | None:
        if not text:
            if self.state in ("after", "named"):
                return ("end", 0, None) if final else WAIT
            return WAIT
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
                if step is WAIT or step[0] != "call":
                    return step if step is WAIT else ("bad", len(text) - len(rest), None)
                gap = len(rest) - len(ARGS) - len(rest[len(ARGS):].lstrip())
                self.state = "named"
                return "call", len(text) - len(rest) + len(ARGS) + gap + step[1], {
                    "name": name.group(), "arguments": step[2]}
            return WAIT if ARGS.startswith(rest) and not final else ("bad", 0, None)
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
