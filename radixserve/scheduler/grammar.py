"""Regex-constrained decoding: which tokens may come next, per request, per step.

The token-level automaton comes from outlines-core (a Rust library; no torch, so the
scheduler process stays light): `Index(regex, vocabulary)` walks the regex's DFA over every
token's bytes once and records, for each DFA state, the tokens that keep a match possible
and the state each leads to. Building it costs milliseconds for simple patterns and a few
hundred for patterns such as `\\w+` that admit most of a 49k vocabulary, so an index is
built once per regex and cached; the per-step cost is a dict lookup of a ready-made mask.

Masks travel to the worker as packed bitmaps (`SeqSampling.allowed_mask`, bit `i` of byte
`i // 8`, little-endian bit order: token `i` allowed): vocab/8 bytes whatever the number
of allowed tokens, built once per (regex, state) and reused.

EOS is allowed only in accepting states (and not with `ignore_eos`); special tokens such
as `<|im_start|>` are never allowed, since they have no text to match.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

MAX_CACHED_REGEXES = 64


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the printable character that stands for each
    byte in a byte-level BPE vocabulary, mapped back to the byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tokenizer_json: dict[str, Any]) -> dict[int, bytes]:
    """Every ordinary token's text as raw bytes, from a `tokenizer.json`.

    Byte-level BPE (GPT-2, Llama 3, SmolLM, Qwen2) spells bytes with printable stand-ins;
    SentencePiece BPE (Llama 2, Mistral) writes spaces as `▁` and rare bytes as `<0xNN>`.
    Special added tokens are left out: no regex can produce them."""
    model = tokenizer_json["model"]
    vocab: dict[str, int] = model.get("vocab") or {}
    decoder = json.dumps(tokenizer_json.get("decoder") or {})
    byte_level = '"ByteLevel"' in decoder
    table = _byte_decoder()
    out: dict[int, bytes] = {}
    for tok, i in vocab.items():
        if byte_level:
            try:
                out[i] = bytes(table[c] for c in tok)
            except KeyError:
                continue  # not a byte-level spelling: cannot be matched
        elif len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
            out[i] = bytes([int(tok[3:5], 16)])
        else:
            out[i] = tok.replace("▁", " ").encode()
    for added in tokenizer_json.get("added_tokens") or []:
        out.pop(added["id"], None)
        if not added.get("special", False):
            out[added["id"]] = added["content"].encode()
    return out


class CompiledRegex:
    """One regex's token-level index plus a cache of per-state masks."""

    def __init__(self, index: Any, vocab_size: int, eos_ids: list[int], vocab_eos: int,
                 seconds: float) -> None:
        self.index = index
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self._vocab_eos = vocab_eos
        self.build_seconds = seconds
        self._masks: dict[tuple[int, bool], bytes] = {}
        self._continues: dict[int, bool] = {}
        self._lock = threading.Lock()

    @property
    def initial_state(self) -> int:
        return self.index.get_initial_state()

    def next_state(self, state: int, token: int) -> int | None:
        """The state after `token`, or None if `token` breaks the match."""
        return self.index.get_next_state(state, token)

    def is_final(self, state: int) -> bool:
        return self.index.is_final_state(state)

    def can_continue(self, state: int) -> bool:
        """Whether any ordinary token may follow (if not and the state accepts, the
        match is complete and the request finishes)."""
        if state not in self._continues:
            allowed = self.index.get_allowed_tokens(state) or []
            self._continues[state] = any(t != self._vocab_eos for t in allowed)
        return self._continues[state]

    def dead(self, state: int) -> bool:
        """A state from which no match can be completed."""
        return not self.is_final(state) and not self.can_continue(state)

    def mask(self, state: int, allow_eos: bool) -> bytes:
        """The packed bitmap of tokens allowed in `state`."""
        key = (state, allow_eos)
        cached = self._masks.get(key)
        if cached is not None:
            return cached
        bits = np.zeros(-(-self.vocab_size // 8) * 8, dtype=bool)
        allowed = [t for t in self.index.get_allowed_tokens(state) or []
                   if t != self._vocab_eos and t < self.vocab_size]
        bits[allowed] = True
        if allow_eos and self.is_final(state):
            bits[[t for t in self.eos_ids if t < self.vocab_size]] = True
        packed = np.packbits(bits, bitorder="little").tobytes()
        with self._lock:
            self._masks[key] = packed
        return packed


class RegexCompiler:
    """Builds (once) and caches token-level indexes for one tokenizer. Thread-safe: the
    Engine compiles in the caller's thread, outside its scheduling lock."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_ids: list[int]) -> None:
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._vocabulary: Any = None
        self._vocab_eos = -1
        self._cache: OrderedDict[str, CompiledRegex] = OrderedDict()
        self._lock = threading.Lock()

    def _outlines_vocabulary(self) -> Any:
        if self._vocabulary is None:
            from outlines_core import Vocabulary

            data = json.loads((self.model_dir / "tokenizer.json").read_text())
            by_bytes: dict[bytes, list[int]] = {}
            eos = set(self.eos_ids)
            for i, raw in token_bytes(data).items():
                if i not in eos and raw:
                    by_bytes.setdefault(raw, []).append(i)
            # outlines-core wants one EOS id that is not an ordinary token; masks re-add
            # the model's own EOS ids in accepting states.
            self._vocab_eos = self.eos_ids[0] if self.eos_ids else self.vocab_size
            self._vocabulary = Vocabulary(self._vocab_eos, by_bytes)
        return self._vocabulary

    def compile(self, regex: str) -> CompiledRegex:
        """The cached index for `regex`; ValueError (naming the field) if it cannot be
        compiled (outlines-core speaks Rust's regex syntax: no look-around, no
        back-references)."""
        import time

        with self._lock:
            hit = self._cache.get(regex)
            if hit is not None:
                self._cache.move_to_end(regex)
                return hit
            try:
                vocabulary = self._outlines_vocabulary()
                from outlines_core import Index
            except (ImportError, OSError, KeyError, ValueError) as e:
                raise ValueError(f"sampling_params.regex is not available for this model: "
                                 f"{e!r} (needs outlines-core and the model's "
                                 "tokenizer.json)") from None

            start = time.perf_counter()
            try:
                index = Index(regex, vocabulary)
            except Exception as e:  # outlines-core raises plain ValueError / RuntimeError
                raise ValueError(f"sampling_params.regex cannot be compiled: {e}") from None
            compiled = CompiledRegex(index, self.vocab_size, self.eos_ids, self._vocab_eos,
                                     time.perf_counter() - start)
            self._cache[regex] = compiled
            if len(self._cache) > MAX_CACHED_REGEXES:
                self._cache.popitem(last=False)
            return compiled


class RegexState:
    """One request's position in its regex's automaton (kept across retractions: it
    depends only on the output tokens, which a retraction keeps)."""

    def __init__(self, compiled: CompiledRegex, ignore_eos: bool) -> None:
        self.compiled = compiled
        self.state: int = compiled.initial_state
        self.allow_eos = not ignore_eos
        self.broken = False

    def mask(self) -> bytes:
        return self.compiled.mask(self.state, self.allow_eos)

    def advance(self, token: int) -> None:
        if token in self.compiled.eos_ids:
            return
        nxt = self.compiled.next_state(self.state, token)
        if nxt is None or self.compiled.dead(nxt):
            self.broken = True  # cannot happen under the mask; guards a vocabulary mismatch
        else:
            self.state = nxt

    @property
    def complete(self) -> bool:
        """An accepting state that no ordinary token can extend: the match is done."""
        return self.compiled.is_final(self.state) and not self.compiled.can_continue(self.state)
