"""Constrained decoding: which tokens may come next, per request, per step.

One backend, xgrammar, for every constraint a request may carry (`SamplingParams.constraint`:
`regex`, `json_schema`, `ebnf`, `structural_tag`). It was chosen over outlines-core by
measurement (bench/grammar.py, bench/results/grammar.md): it compiles a JSON schema in
milliseconds where outlines-core's token-level DFA takes tens to hundreds, and fills a mask
in microseconds from any state, where a DFA's per-state mask must be built and cached.

- `GrammarCompiler` compiles a constraint once per (kind, text) and keeps an LRU of them
  (`MAX_CACHED_GRAMMARS`); errors are ValueErrors naming the field. Thread-safe: the Engine
  compiles in the caller's thread, outside the lock its loop needs.
- `Grammar` is one compiled constraint, shared read-only by the requests that use it.
- `GrammarState` is one sequence's matcher (a pushdown automaton over the output tokens):
  it depends on the output tokens only, so a retraction keeps it, and each parallel sample
  has its own.

Masks travel to the worker as packed bitmaps (`SeqSampling.allowed_mask`: bit `i` of byte
`i // 8`, little-endian bit order, token `i` allowed). xgrammar fills an int32 bitmask whose
bytes, little-endian, are exactly that bitmap, so a mask is sent as the matcher wrote it.

The vocabulary is handed to xgrammar as raw bytes (`token_bytes`), special tokens as empty
strings, which xgrammar never allows: `<|im_start|>` has no text a grammar could match. The
model's EOS ids are its stop tokens, allowed only where the grammar accepts (and never with
`ignore_eos`).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

MAX_CACHED_GRAMMARS = 64
"""Compiled constraints kept (least recently used dropped first); a JSON schema's grammar
takes tens of KB to a few MB."""

_XGRAMMAR_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")
"""xgrammar's error prefix (`[13:14:24] /project/cpp/regex_converter.cc:94: `): noise to a
caller, so cut from the messages."""


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
    Special added tokens are left out: no grammar can produce them."""
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


def _xgrammar_message(error: Exception) -> str:
    return _XGRAMMAR_LOCATION.sub("", str(error).strip().splitlines()[0])


def _structural_tag(text: str) -> str:
    """xgrammar's structural tag (JSON) for SGLang's `structural_tag` parameter.

    SGLang's OpenAI `response_format` `{"type": "structural_tag", "structures": [{"begin",
    "schema", "end"}], "triggers": [...]}` means: free text until a trigger, then a tag whose
    body follows its JSON schema, then free text again; that is xgrammar's `triggered_tags`
    format, spelled out here. xgrammar's own `{"type": "structural_tag", "format": {...}}` is
    taken as it is."""
    spec = json.loads(text)
    if not isinstance(spec, dict):
        raise ValueError("must be a JSON object")
    if "format" in spec:
        return text
    if not {"structures", "triggers"} <= spec.keys():
        raise ValueError('needs "structures" and "triggers" (SGLang) or "format" (xgrammar)')
    tags = [{"type": "tag", "begin": s["begin"], "end": s["end"],
             "content": {"type": "json_schema", "json_schema": s["schema"]}}
            for s in spec["structures"]]
    return json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": spec["triggers"], "tags": tags}})


class Grammar:
    """One compiled constraint: the xgrammar grammar, and where the EOS ids sit in a mask."""

    def __init__(self, kind: str, compiled: Any, vocab_size: int, eos_ids: list[int],
                 seconds: float) -> None:
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

    def matcher(self) -> Any:
        import xgrammar

        return xgrammar.GrammarMatcher(self.compiled)  # stop tokens: the TokenizerInfo's


class GrammarCompiler:
    """Compiles constraints for one tokenizer, once each, and keeps the most recent."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_ids: list[int],
                 max_compile_seconds: float | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.max_compile_seconds = max_compile_seconds
        """A compile that takes longer is refused (None: no bound). xgrammar cannot be
        interrupted, so the compile finishes in its thread (xgrammar releases the GIL)
        and its result is dropped; the text is then refused at once (`_too_slow`)."""
        self._too_slow: OrderedDict[tuple[str, str], float] = OrderedDict()
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self.compiles = 0
        """Constraints compiled (cache misses that succeeded)."""
        self._xgrammar: Any = None
        self._cache: OrderedDict[tuple[str | None, str, str], Grammar] = OrderedDict()
        """By (cache namespace, kind, text): a hit skips a compile that can take a good
        part of a second, so like the radix cache it is not shared across tenants (a
        faster answer would tell one tenant which schema another uses)."""
        self._lock = threading.Lock()
        """Guards the cache and the lazy set-up, not compilation: a long compile in one
        thread must not hold up a cache hit in another (the Engine's loop)."""

    def _compiler(self) -> Any:
        """xgrammar's compiler over this model's vocabulary, built on first use (importing
        xgrammar takes a second; a server that never constrains never pays it)."""
        with self._lock:
            if self._xgrammar is None:
                import xgrammar

                data = json.loads((self.model_dir / "tokenizer.json").read_text())
                spelled = token_bytes(data)
                eos = set(self.eos_ids)
                vocab = [b"" if i in eos else spelled.get(i, b"") for i in range(self.vocab_size)]
                info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW,
                                              vocab_size=self.vocab_size,
                                              stop_token_ids=self.eos_ids or None)
                # Our LRU is the one cache: xgrammar's would hold every grammar, unbounded.
                self._xgrammar = xgrammar.GrammarCompiler(info, cache_enabled=False)
            return self._xgrammar

    def compile(self, kind: str, text: str, namespace: str | None = None) -> Grammar:
        """The compiled constraint `kind` (a SamplingParams field: regex, json_schema, ebnf,
        structural_tag) of `text`, cached per cache `namespace` (tenant and cache_salt).
        ValueError naming `sampling_params.<kind>` if it does not compile, or admits no
        non-empty output in this vocabulary."""
        key = (namespace, kind, text)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        try:
            compiler = self._compiler()
        except (ImportError, OSError, KeyError, ValueError) as e:
            raise ValueError(f"sampling_params.{kind} is not available for this model: {e!r} "
                             "(needs xgrammar and the model's tokenizer.json)") from None
        start = time.perf_counter()
        grammar = Grammar(kind, self._build_bounded(compiler, kind, text), self.vocab_size,
                          self.eos_ids, time.perf_counter() - start)
        if not GrammarState(grammar, ignore_eos=True).can_continue:
            raise ValueError(f"sampling_params.{kind} admits no non-empty output in this "
                             "vocabulary")
        with self._lock:
            grammar = self._cache.setdefault(key, grammar)  # a racing compile may have won
            self._cache.move_to_end(key)
            self.compiles += 1
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return grammar

    def _build_bounded(self, compiler: Any, kind: str, text: str) -> Any:
        """`_build` within `max_compile_seconds`, or a ValueError naming the limit."""
        limit = self.max_compile_seconds
        if limit is None:
            return self._build(compiler, kind, text)
        key = (kind, text)

        def refuse() -> ValueError:
            return ValueError(
                f"sampling_params.{kind} did not compile within max_grammar_compile_seconds="
                f"{limit:g} (--max-grammar-compile-seconds): simplify it (large repetition "
                "counts such as {1,2000} are the usual cause)")

        with self._lock:
            if key in self._too_slow:
                raise refuse()
        done = threading.Event()
        outcome: list[Any] = []

        def run() -> None:
            try:
                outcome.append((True, self._build(compiler, kind, text)))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                outcome.append((False, e))
            done.set()

        threading.Thread(target=run, name="grammar-compile", daemon=True).start()
        if not done.wait(limit):
            with self._lock:
                self._too_slow[key] = limit
                if len(self._too_slow) > MAX_CACHED_GRAMMARS:
                    self._too_slow.popitem(last=False)
            raise refuse()
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    @staticmethod
    def _build(compiler: Any, kind: str, text: str) -> Any:
        field = f"sampling_params.{kind}"
        try:
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "json_schema":
                json.loads(text)  # a clearer error than the C++ parser's
                # Compact JSON (", " and ": ", no free whitespace): a model allowed any
                # whitespace may emit it until max_new_tokens and never close the object.
                return compiler.compile_json_schema(text, any_whitespace=False)
            if kind == "ebnf":
                return compiler.compile_grammar(text)
            if kind == "structural_tag":
                return compiler.compile_structural_tag(_structural_tag(text))
        except json.JSONDecodeError as e:
            raise ValueError(f"{field} is not valid JSON: {e}") from None
        except (KeyError, TypeError) as e:
            raise ValueError(f"{field} is malformed: missing or wrong field {e}") from None
        except Exception as e:  # xgrammar raises RuntimeError (and its own subclasses)
            raise ValueError(f"{field} cannot be compiled: {_xgrammar_message(e)}") from None
        raise ValueError(f"unknown constraint kind {kind!r}")


class GrammarState:
    """One sequence's place in its grammar, with the mask for its next token.

    The mask is filled when the state changes (at the start and after each token), since
    whether the output is complete depends on it; `mask()` then only hands it out."""

    def __init__(self, grammar: Grammar, ignore_eos: bool) -> None:
        self.grammar = grammar
        self.allow_eos = not ignore_eos
        self.broken = False
        self.can_continue = True
        """Some ordinary token may come next."""
        self._matcher = grammar.matcher()
        self._words = np.zeros(-(-grammar.vocab_size // 32), dtype=np.int32)
        self._fill()

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
        # Neither can happen under the mask; they guard a vocabulary mismatch.
        if not self._matcher.accept_token(token):
            self.broken = True
            return
        self._fill()
        if not self.can_continue and not self.accepted:
            self.broken = True  # a dead end: no token leads on, and the output is not accepted

    @property
    def accepted(self) -> bool:
        """The output so far is a whole match of the grammar (EOS may end it here)."""
        return self._matcher.is_completed()

    @property
    def complete(self) -> bool:
        """The output is accepted and no ordinary token can extend it: the request is done."""
        return not self.can_continue and self.accepted
