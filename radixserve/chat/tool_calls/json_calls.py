"""Calls written as JSON objects after a trigger in free text: the base of the Mistral and
Llama 3 parsers."""

from __future__ import annotations

from typing import Any

from radixserve.chat.tool_calls.base import (DECODER, Content, Delta, FormatParser,
                                             call_delta, partial_suffix, read_call)

WAIT = None
"""`JsonCalls._step`: the text so far cannot tell yet."""


class JsonCalls(FormatParser):
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
        super().__init__(names, parallel)
        self.buffer = ""
        """Text not yet given out: the block being read, or what may begin one."""
        self.in_block = False
        self.state = ""
        """Where the subclass is in the block."""
        self.head = ""
        """The block's text read so far while no call was read in it (content if it fails)."""
        self.seen_call = False
        self.started = not self.AT_START
        self.content = Content()

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
            if step is WAIT:
                if final:  # nothing more will come: what is left is no call
                    self._fail(len(self.buffer), out)
                return out
            kind, used, value = step
            used += gap
            if kind == "call":
                call = read_call(value, self.names)
                if call is None:
                    self._fail(used, out)
                    continue
                if self.calls == 0 or self.parallel:
                    out.append(call_delta(self.calls, *call))
                    self.calls += 1
                self.seen_call = True
            elif kind == "bad":
                self._fail(used, out)
                continue
            elif not self.seen_call:
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
                                       partial_suffix(self.buffer, self.TRIGGER))
            out += self.content.add(self.buffer[:keep])
            self.buffer = self.buffer[keep:]
            return False
        return self._enter(at, len(self.TRIGGER), out)

    def _enter(self, at: int, trigger: int, out: list[Delta]) -> bool:
        out += self.content.add(self.buffer[:at])
        self.head, self.buffer = self.buffer[at:at + trigger], self.buffer[at + trigger:]
        self.in_block, self.seen_call, self.state = True, False, "start"
        return True

    def _fail(self, used: int, out: list[Delta]) -> None:
        """The block ends in what is not a call: its first `used` characters (with the block's
        head when no call was read) are content."""
        raw = ("" if self.seen_call else self.head) + self.buffer[:used]
        out += self.content.add(raw)
        self.buffer, self.in_block = self.buffer[used:], False

    def _step(self, text: str, final: bool) -> tuple[str, int, Any] | None:
        """What begins `text` (the block's rest, whitespace skipped): ("call", length,
        object), ("sep", length, None) for what goes between calls, ("end", length, None)
        where the block ends, ("bad", length, None), or `WAIT`."""
        raise NotImplementedError

    def _then(self, state: str, step: tuple[str, int, Any] | None
              ) -> tuple[str, int, Any] | None:
        """`step`, moving to `state` unless it waits."""
        if step is not WAIT:
            self.state = state
        return step

    @staticmethod
    def _object(text: str) -> tuple[str, int, Any] | None:
        """A JSON object opening `text`, once it is complete."""
        if not text:
            return WAIT
        if text[0] != "{":
            return "bad", 0, None
        try:
            value, end = DECODER.raw_decode(text)
        except ValueError:
            return WAIT  # not complete yet (or never: then the end of the output tells)
        return "call", end, value
