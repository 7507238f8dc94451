"""The parsers of constrained output: under `tool_choice` required the model writes an array
of calls (a JSON schema makes it), under a named function only that function's arguments."""

from __future__ import annotations

from radixserve.chat.tool_calls.base import (DECODER, Delta, ToolCallParser, call_delta,
                                             read_call)


class CallArrayParser(ToolCallParser):
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
                value, end = DECODER.raw_decode(self.buffer, at)
            except ValueError:
                break  # not complete yet
            call = read_call(value, self.names)
            if call is None:
                break
            out.append(call_delta(self.calls, *call))
            self.calls += 1
            self.read, self.closed = end, not self.parallel
        return out

    def finish(self) -> list[Delta]:
        if self.closed:
            return []
        rest = (self.buffer[self.read:] if self.calls else self.buffer).strip()
        return [{"content": rest}] if rest else []


class ArgumentsParser(ToolCallParser):
    """A named function: the whole output is its arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = 0

    def feed(self, text: str) -> list[Delta]:
        if not text:
            return []
        named = self.name if self.calls == 0 else None
        self.calls = 1
        return [call_delta(0, named, text)]

    def finish(self) -> list[Delta]:
        if self.calls:
            return []
        self.calls = 1
        return [call_delta(0, self.name, "")]  # nothing was generated: an empty call
