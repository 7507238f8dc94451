"""Hermes tool calls: `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks in
free text, as Qwen2.5's and Qwen3's templates (and radixserve's fallback prompt) ask."""

from __future__ import annotations

from radixserve.chat.tool_calls.base import (Content, Delta, FormatParser, call_delta,
                                             json_arguments, partial_suffix, read_call)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(FormatParser):
    """`auto`: `<tool_call>{json}</tool_call>` blocks out of free text. Text before a
    block streams as content at once, except an end that may be the start of `<tool_call>`;
    a block goes out as one call delta once it is closed (or the output ends inside it). A
    block that does not hold a call of an offered function stays content, as written."""

    FORMAT = "hermes"
    DESCRIPTION = "Hermes <tool_call> blocks"

    def __init__(self, names: set[str], parallel: bool) -> None:
        super().__init__(names, parallel)
        self.buffer = ""
        """Text not yet given out: an open block, or what may begin one."""
        self.in_block = False
        self.content = Content()

    def feed(self, text: str) -> list[Delta]:
        self.buffer += text
        out: list[Delta] = []
        while True:
            if not self.in_block:
                at = self.buffer.find(OPEN)
                if at < 0:
                    keep = len(self.buffer) - partial_suffix(self.buffer, OPEN)
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
        call = read_call(json_arguments(inner.strip()), self.names)
        if call is None:
            return self.content.add(raw)
        if self.calls and not self.parallel:
            return []  # parallel_tool_calls: false allows one call
        self.calls += 1
        return [call_delta(self.calls - 1, *call)]
