"""Llama 3.1/3.2 tool calls: an answer opening with `{"name", "parameters"}` objects
separated by `;`, or after `<|python_tag|>`."""

from __future__ import annotations

from typing import Any

from radixserve.chat.tool_calls.json_calls import WAIT, JsonCalls


class Llama3Parser(JsonCalls):
    """`auto` for Llama 3.1/3.2's templates: the answer is a call when it opens with a JSON
    object `{"name": ..., "parameters": {...}}` (or one after `<|python_tag|>`, a special
    token the server keeps in the text of such a request), possibly several separated by
    `;`. A JSON object later in the text, not after the tag, is text."""

    FORMAT = "llama3"
    DESCRIPTION = "Llama 3's JSON calls"
    TRIGGER = "<|python_tag|>"
    AT_START = True

    def _step(self, text: str, final: bool) -> tuple[str, int, Any] | None:
        if self.state == "after":
            if not text:
                return ("end", 0, None) if final else WAIT
            if text[0] == ";":
                self.state = "start"
                return "sep", 1, None
            return "end", 0, None
        return self._then("after", self._object(text)) if text else WAIT
