"""Prompt lookup: drafts for one sequence copied from earlier in its own tokens.

The longest n-gram at the tail of the sequence (``max_ngram`` tokens down to ``min_ngram``)
that also occurred earlier proposes what followed its most recent earlier occurrence (as
llama.cpp's lookup decoding and vLLM's n-gram proposer do). Agents and few-shot prompts
copy names, JSON keys and whole phrases out of their context, so that continuation is often
what the model writes next; verification makes a wrong guess cost only its checking.

Cost: each appended token files its n-grams in a map from n-gram to the end of its latest
occurrence (``max_ngram - min_ngram + 1`` dict writes), so a proposal is one lookup per
n-gram length, not a scan of the context. Keys are the n-grams' hashes (an int, not a tuple
kept per entry: ~100 bytes per filed n-gram), and a hit is compared with the tokens it names,
so a hash collision never proposes anything.
"""

from __future__ import annotations

from collections.abc import Iterable


class ContextLookup:
    """A sequence's tokens (fed by `extend`) and the drafts they propose (`propose`).

    ``min_ngram`` is 2 by default: a single token (a comma, a quote, "the") recurs with many
    different successors, so its latest occurrence is a poor guess, and a wrong draft costs
    verification work. On held-out files of this repository (bench/results/draft_sources.md, drafts
    of up to 8), one-token matches raised tokens per step from 1.30 to 1.43 but drafted 5.8
    tokens per step instead of 2.2, at a precision of 0.074 instead of 0.134; three-token
    matches gave 1.20 at 0.179. Up to ``max_ngram`` (4) the longest match wins, which
    prefers the copy the sequence is actually in the middle of.
    """

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        # hash(n-gram) -> end position of its latest occurrence *before the tail*: the
        # n-grams ending at the last token are filed only once another token follows them,
        # so the tail never finds itself.
        self._last_end: dict[int, int] = {}

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` (the prompt, then each accepted token) to the sequence."""
        toks, last_end = self.tokens, self._last_end
        lo, hi = self.min_ngram, self.max_ngram
        for token in tokens:
            end = len(toks) - 1  # the old tail's last token is no longer the tail
            for n in range(lo, min(hi, end + 1) + 1):
                last_end[hash(tuple(toks[end - n + 1:end + 1]))] = end
            toks.append(token)

    def propose(self, max_len: int) -> list[int]:
        """Up to ``max_len`` tokens that followed the latest earlier occurrence of the
        longest matching tail n-gram ([] when none matches). Where that continuation runs
        into the tail itself, it goes on repeating the period it found (``a b a b`` -> ``a b
        a b ...``), as the sequence would if it kept repeating."""
        toks, n_toks = self.tokens, len(self.tokens)
        if max_len <= 0:
            return []
        for n in range(min(self.max_ngram, n_toks - 1), self.min_ngram - 1, -1):
            gram = toks[n_toks - n:]
            end = self._last_end.get(hash(tuple(gram)))
            if end is None or toks[end - n + 1:end + 1] != gram:
                continue
            out: list[int] = []
            for i in range(end + 1, end + 1 + max_len):
                # i - n_toks < len(out) because end + 1 < n_toks: a repeat of the draft
                out.append(toks[i] if i < n_toks else out[i - n_toks])
            return out
        return []
