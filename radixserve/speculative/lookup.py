"""Prompt lookup: a sequence drafts from its own context. The tail's longest n-gram (4 down
to 2 tokens) found earlier in the sequence proposes what followed its most recent
occurrence there. This first version scans the context backwards on each call."""
from __future__ import annotations


class ContextLookup:
    def __init__(self, max_ngram: int = 4, min_ngram: int = 2) -> None:
        self.tokens: list[int] = []
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def extend(self, tokens) -> None:
        self.tokens.extend(tokens)

    def propose(self, max_len: int) -> list[int]:
        t = self.tokens
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(t) <= n:
                continue
            tail = t[-n:]
            for i in range(len(t) - n - 1, -1, -1):
                if t[i:i + n] == tail:
                    return t[i + n:i + n + max_len]
        return []
