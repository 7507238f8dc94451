"""Incremental detokenization for streaming.

Decoding each new token alone breaks characters that span tokens (a byte-level BPE emits
UTF-8 bytes) and spacing that depends on the previous token; decoding the whole output at
every step costs O(n^2). Like vLLM and SGLang, decode a short window that starts a few
tokens back and emit only the text past what that window's prefix decodes to, holding
back anything that ends in an incomplete character. With stop strings or patterns, a tail
that is or could still become a match is held back too (see `Stops.shown`), so a client
never sees text that the final answer trims away. If where a pattern's match may begin
cannot be told in time (`PartialTimeout`), the rest of the text is held back until the
request ends (`finish`).
"""

from __future__ import annotations

from typing import Any

from radixserve.messages import SamplingParams, TokenizedRequest
from radixserve.stop_strings import (PartialBudget, PartialTimeout, Stops, Decode,
                                     uncounted)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, sampling: SamplingParams | None = None) -> None:
        """Decodes as `sampling` says (`skip_special_tokens`, `spaces_between_special_tokens`)
        and holds back its stops."""
        self._decoder: Decode = tokenizer.decode
        self.sampling = sampling if sampling is not None else SamplingParams()
        self.stops = Stops.of(self.sampling)
        self.ids: list[int] = []
        self.text = ""
        """Everything decoded so far (some of it maybe not yet emitted)."""
        self.emitted = 0
        self._prefix_offset = 0
        self._read_offset = 0
        self._after: int | None = None
        """The length of the text no stop may end in (`uncounted` tokens), once known."""
        self._partial = PartialBudget()
        self._held = False
        """Partial-match searches ran past their budget: nothing more is shown before
        `finish`."""

    def _decode(self, ids: list[int]) -> str:
        sp = self.sampling
        return self._decoder(ids, skip_special_tokens=sp.skip_special_tokens,
                             spaces_between_special_tokens=sp.spaces_between_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Feed new tokens; returns the text that is now safe to show."""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self._prefix_offset:self._read_offset])
        window = self._decode(self.ids[self._prefix_offset:])
        if len(window) > len(prefix) and not window.endswith("\ufffd"):
            self.text += window[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        safe = len(self.text)
        if self._held:
            return ""
        if self.stops:
            try:
                safe = self.stops.shown(self.text, self._stops_after(), self.emitted,
                                        self._partial)
            except PartialTimeout:
                self._held = True
                return ""
        if safe <= self.emitted:
            return ""
        delta, self.emitted = self.text[self.emitted:safe], safe
        return delta

    def _stops_after(self) -> int:
        old = uncounted(self.sampling.min_new_tokens)
        if self._after is None and len(self.ids) >= old:
            self._after = len(self._decode(self.ids[:old]))
        # Until those tokens are all out, every match so far ends in their text.
        return self._after if self._after is not None else len(self.text)

    def finish(self, final_text: str) -> str:
        """The rest of `final_text` (the whole answer, stops trimmed) after what has been
        emitted. Call it instead of `add` for the last tokens: emitted text is always a
        prefix of the final text, because a stop's first characters are held back until
        the token that completes it."""
        delta = final_text[self.emitted:]
        self.emitted = len(final_text)
        return delta


class StreamedText:
    """The text of a streamed call's chunks, per output (a beam's come in the result only):
    what the front door sends as `ChunkReply`s and `Engine.generate(stream=True)` yields."""

    def __init__(self, tokenizer: Any, requests: list[TokenizedRequest]) -> None:
        outputs = [req for req in requests for _ in range(req.num_outputs)]
        self.live = {index: IncrementalDetokenizer(tokenizer, req.sampling)
                     for index, req in enumerate(outputs) if req.beam is None}
        """The outputs whose stream has not ended, by index."""

    def chunk(self, index: int, new_ids: list[int], final_text: str | None) -> str | None:
        """The text output `index`'s `new_ids` add; with its `final_text` (it finished),
        all that is left, which ends its stream. None when it streams nothing (a beam, or
        an output whose stream has ended)."""
        detok = self.live.get(index)
        if detok is None:
            return None
        if final_text is None:
            return detok.add(new_ids)
        del self.live[index]
        return detok.finish(final_text)
