"""Incremental detokenization for streaming.

Decoding each new token alone breaks characters that span tokens (a byte-level BPE emits
UTF-8 bytes) and spacing that depends on the previous token; decoding the whole output at
every step costs O(n^2). Like vLLM and SGLang, decode a short window that starts a few
tokens back and emit only the text past what that window's prefix decodes to, holding
back anything that ends in an incomplete character. With stop strings, a tail that could
still become a stop string is held back too, so a client never sees text that the final
answer trims away.
"""

from __future__ import annotations

from typing import Any

from radixserve.stop_strings import holdback, stop_decoder


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True,
                 stop: list[str] | None = None) -> None:
        self._decoder = stop_decoder(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        """Everything decoded so far (some of it maybe not yet emitted)."""
        self.emitted = 0
        self._prefix_offset = 0
        self._read_offset = 0
        self._holdback = holdback(stop or [])

    def _decode(self, ids: list[int]) -> str:
        return self._decoder(ids, self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Feed new tokens; returns the text that is now safe to show."""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self._prefix_offset:self._read_offset])
        window = self._decode(self.ids[self._prefix_offset:])
        if len(window) > len(prefix) and not window.endswith("\ufffd"):
            self.text += window[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        safe = len(self.text) - self._holdback
        if safe <= self.emitted:
            return ""
        delta, self.emitted = self.text[self.emitted:safe], safe
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of `final_text` (the whole answer, stop strings trimmed) after what has
        been emitted. Call it instead of `add` for the last tokens: emitted text is always
        a prefix of the final text, because a stop string's first characters are held back
        until the token that completes it."""
        delta = final_text[self.emitted:]
        self.emitted = len(final_text)
        return delta
