"""Constrained decoding: which tokens may come next, per request, per step.

One backend, xgrammar, for every constraint a request may carry (`SamplingParams.constraint`:
`regex`, `json_schema`, `ebnf`, `structural_tag`). It was chosen over outlines-core by
measurement (bench/results/grammar.md): it compiles a JSON schema in
milliseconds where outlines-core's token-level DFA takes tens to hundreds, and fills a mask
in microseconds from any state, where a DFA's per-state mask must be built and cached.

- `Grammar` is one compiled constraint, shared read-only by the requests that use it
  (compiled off the scheduler's loop by scheduler/grammar_compiler.py).
- `GrammarState` is one sequence's matcher (a pushdown automaton over the output tokens):
  it depends on the output tokens only, so a retraction keeps it, and each parallel sample
  has its own.

Masks travel to the worker as packed bitmaps (`SeqSampling.allowed_mask`: bit `i` of byte
`i // 8`, little-endian bit order, token `i` allowed). xgrammar fills an int32 bitmask whose
bytes, little-endian, are exactly that bitmap, so a mask is sent as the matcher wrote it.

The model's EOS ids are its stop tokens, allowed only where the grammar accepts (and never
with `ignore_eos`).

Following a token runs in the scheduler's loop, and an ambiguous grammar (`x ::= x x | "a"`)
makes each token cost more than the last (0.1 ms at first, tens of ms by token 100). So a
sequence's matcher works on credit (`GrammarState.over_budget`): each token it follows adds
its part of `GRAMMAR_STEP_SECONDS` (a request's, shared by its samples) and takes what the
token cost, the credit holding at most `GRAMMAR_BURST_STEPS` tokens' worth; once it is
spent, the output ends with an abort naming the bound. A pause of the whole process (a
collection, a busy machine) is absorbed by the credit; a grammar slower than its share at
every token is not.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # imported when first used: it takes a second
    import xgrammar


class Grammar:
    """One compiled constraint: the xgrammar grammar, and where the EOS ids sit in a mask."""

    def __init__(self, kind: str, compiled: xgrammar.CompiledGrammar, vocab_size: int,
                 eos_ids: list[int], seconds: float) -> None:
        self.kind = kind
        self.compiled = compiled
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.build_seconds = seconds
        self.mask_bytes = -(-vocab_size // 8)
        bits: dict[int, int] = {}  # one entry per word: EOS ids 0 and 2 share word 0
        for t in eos_ids:
            if t < vocab_size:
                bits[t // 32] = bits.get(t // 32, 0) | 1 << (t % 32)
        self.eos_words = np.array(list(bits), dtype=np.int64)
        self.eos_bits = np.array(list(bits.values()), dtype=np.uint32).view(np.int32)

    def matcher(self) -> xgrammar.GrammarMatcher:
        import xgrammar

        return xgrammar.GrammarMatcher(self.compiled)  # stop tokens: the TokenizerInfo's


GRAMMAR_STEP_SECONDS = 0.02
"""The time a request's matchers may take to follow one token each, its samples' together,
on average (see the module's docstring)."""
GRAMMAR_BURST_STEPS = 25
"""How many tokens' worth of that time a matcher may hold as credit."""


class GrammarState:
    """One sequence's place in its grammar, with the mask for its next token.

    The mask is filled when the state changes (at the start and after each token), since
    whether the output is complete depends on it; `mask()` then only hands it out."""

    def __init__(self, grammar: Grammar, ignore_eos: bool, samples: int = 1) -> None:
        self.grammar = grammar
        self.allow_eos = not ignore_eos
        self.broken = False
        self.can_continue = True
        """Some ordinary token may come next."""
        self.share = GRAMMAR_STEP_SECONDS / max(samples, 1)
        """This sequence's time per token followed (its request's, shared by its samples)."""
        self.credit = self.share * GRAMMAR_BURST_STEPS
        self.over_budget: str | None = None
        """Why the output ends, once following tokens took more than its share."""
        self._matcher = grammar.matcher()
        self._words = np.zeros(-(-grammar.vocab_size // 32), dtype=np.int32)
        self._fill()

    def _spend(self, began: float, tokens: int = 1) -> None:
        """Charge the time since `began` (following `tokens` tokens) to the credit."""
        most = self.share * GRAMMAR_BURST_STEPS
        self.credit = min(self.credit + self.share * tokens, most) - (time.perf_counter()
                                                                     - began)
        if self.credit < 0 and self.over_budget is None:
            self.over_budget = (
                f"following the output's constraint (sampling_params.{self.grammar.kind}) "
                f"took more than its budget of {GRAMMAR_STEP_SECONDS * 1000:g} ms per token "
                "(a request's, shared by its samples): an ambiguous grammar? Write it so "
                "that each text has one parse")

    def _fill(self) -> None:
        g, words = self.grammar, self._words
        self._matcher.fill_next_token_bitmask(words)
        eos = words[g.eos_words] & g.eos_bits
        words[g.eos_words] &= ~g.eos_bits
        self.can_continue = bool(words.any())
        if self.allow_eos:
            words[g.eos_words] |= eos

    def mask(self) -> bytes:
        """The packed bitmap of the tokens allowed next."""
        packed = self._words.astype("<i4", copy=False).view(np.uint8)
        return packed[:self.grammar.mask_bytes].tobytes()

    def advance(self, token: int) -> None:
        if token in self.grammar.eos_ids:
            return  # the request ends here; the matcher need not know
        began = time.perf_counter()
        # Neither can happen under the mask; they guard a vocabulary mismatch.
        if not self._matcher.accept_token(token):
            self.broken = True
            return
        self._fill()
        self._spend(began)
        if not self.can_continue and not self.accepted:
            self.broken = True  # a dead end: no token leads on, and the output is not accepted

    def check_draft(self, draft: list[int]) -> tuple[list[int], list[bytes]]:
        """Speculative decoding: the longest prefix of `draft` the grammar allows from
        here (up to an EOS, which would end the output), and the mask after each of its
        tokens, for the rows that verify what follows them (after an EOS, which ends the
        output, the row's mask is moot: the one before it). The state is as before."""
        masks: list[bytes] = []
        advanced = 0
        began = time.perf_counter()
        for token in draft:
            word = int(self._words[token >> 5]) if token < self.grammar.vocab_size else 0
            if not word >> (token & 31) & 1:
                break
            if token in self.grammar.eos_ids:
                masks.append(self.mask())
                break
            if not self._matcher.accept_token(token):
                break  # not under the mask; guards a vocabulary mismatch
            advanced += 1
            self._fill()
            masks.append(self.mask())
            if not self.can_continue:
                break
        if advanced:
            self._matcher.rollback(advanced)
            self._fill()
            self._spend(began, 0)  # the draft's tokens are followed again when accepted
        return draft[:len(masks)], masks

    @property
    def accepted(self) -> bool:
        """The output so far is a whole match of the grammar (EOS may end it here)."""
        return self._matcher.is_completed()

    @property
    def complete(self) -> bool:
        """The output is accepted and no ordinary token can extend it: the request is done."""
        return not self.can_continue and self.accepted
