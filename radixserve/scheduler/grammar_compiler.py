"""Compiling output constraints (scheduler/grammar.py) with xgrammar, off the scheduler's loop.

- `GrammarCompiler` compiles a constraint once per (namespace, kind, text) and keeps an LRU
  of them (`MAX_CACHED_GRAMMARS`); errors are ValueErrors naming the field. Compiles run in
  a small pool of threads, never in the scheduler's loop: a request whose constraint is not
  cached waits for it while the others are scheduled.

The vocabulary is handed to xgrammar as raw bytes (`token_bytes`), special tokens as empty
strings, which xgrammar never allows: `<|im_start|>` has no text a grammar could match.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixserve.scheduler.grammar import Grammar, GrammarState

if TYPE_CHECKING:  # imported when first used: it takes a second
    import xgrammar

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


class CompilerBusy(RuntimeError):
    """Too many constraints are compiling or waiting to; the request was not taken."""


class Compile:
    """One constraint compiling in the compiler's pool, as the requests that wait for it
    see it."""

    def __init__(self, kind: str, text: str, namespace: str | None = None,
                 tenant: str | None = None) -> None:
        self.kind, self.text, self.namespace, self.tenant = kind, text, namespace, tenant
        self.future: Future[Grammar] | None = None
        self.queued = time.monotonic()
        self.started: float | None = None
        """When a pool thread took it up (None while it waits for one)."""
        self.timed_out = False


class GrammarCompiler:
    """Compiles constraints for one tokenizer, once each, and keeps the most recent.

    Compiles run in a pool of `threads` threads, never in the caller's loop: `start` hands
    one out and `outcome` says, without waiting, whether it is done. At most `max_pending`
    compile (or wait for a thread) at once; past that `start` raises CompilerBusy, as does
    `outcome` for one that waited `max_compile_seconds` for a thread (it never runs). A compile
    running longer than `max_compile_seconds` fails its requests at once; xgrammar cannot be
    interrupted, so it finishes in its thread (xgrammar releases the GIL), its result is
    dropped and its text refused at once from then on for that cache namespace only
    (`_too_slow`: another tenant learns nothing from it). So the threads never pile up:
    there are `threads` of them, however slow the constraints.

    One tenant holds at most `max_per_tenant` of them (compiling, waiting for a thread, or
    still running past its deadline), so one tenant's slow schemas leave the other threads
    to the others; past that its `start` raises CompilerBusy naming the limit."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_ids: list[int],
                 max_compile_seconds: float | None = None, threads: int = 2,
                 max_pending: int = 64, max_per_tenant: int | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.max_compile_seconds = max_compile_seconds
        """A compile that takes longer is refused (None: no bound)."""
        self.max_pending, self.threads = max_pending, threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar-compile")
        self._inflight: dict[tuple[str | None, str, str], Compile] = {}
        """Compiles not finished, by cache key: requests of the same constraint share one."""
        self._too_slow: OrderedDict[tuple[str | None, str, str], float] = OrderedDict()
        """By (cache namespace, kind, text), as the cache: a refusal tells no other tenant
        that someone sent that text."""
        self.max_per_tenant = max_per_tenant
        """Compile threads one tenant may hold (None: no bound, as for the Engine)."""
        self._held: Counter[str] = Counter()
        """Compiles per tenant not yet off their thread (or out of the queue)."""
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self.compiles = 0
        """Constraints compiled (cache misses that succeeded)."""
        self._xgrammar: xgrammar.GrammarCompiler | None = None
        self._cache: OrderedDict[tuple[str | None, str, str], Grammar] = OrderedDict()
        """By (cache namespace, kind, text): a hit skips a compile that can take a good
        part of a second, so like the radix cache it is not shared across tenants (a
        faster answer would tell one tenant which schema another uses)."""
        self._lock = threading.Lock()
        """Guards the cache, the compiles in flight and the lazy set-up, not compilation:
        a long compile must not hold up a cache hit in the scheduler's loop."""

    def _compiler(self) -> xgrammar.GrammarCompiler:
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

    def cached(self, kind: str, text: str, namespace: str | None = None) -> Grammar | None:
        """The compiled constraint if it is at hand, else None (nothing is started)."""
        key = (namespace, kind, text)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    def start(self, kind: str, text: str, namespace: str | None = None,
              tenant: str | None = None) -> Compile:
        """Start compiling `kind` (a SamplingParams field: regex, json_schema, ebnf,
        structural_tag) of `text` for cache `namespace` (tenant and cache_salt) on behalf
        of `tenant`, or join the compile of it already running. ValueError for a text
        known to be too slow in that namespace, CompilerBusy when `max_pending` compiles
        are in flight or the tenant holds `max_per_tenant` compile threads."""
        key = (namespace, kind, text)
        with self._lock:
            if key in self._too_slow:
                raise self._refuse(kind)
            running = self._inflight.get(key)
            if running is not None:
                return running
            if len(self._inflight) >= self.max_pending:
                raise CompilerBusy(
                    f"server overloaded: {len(self._inflight)} output constraints are "
                    f"compiling (max_pending_grammar_compiles={self.max_pending})")
            if tenant is not None and self.max_per_tenant is not None \
                    and self._held[tenant] >= self.max_per_tenant:
                raise CompilerBusy(
                    f"overloaded: this tenant has {self._held[tenant]} output constraints "
                    f"compiling (max_grammar_compiles_per_tenant={self.max_per_tenant}); "
                    "retry when they are done")
            handle = self._inflight[key] = Compile(kind, text, namespace, tenant)
            if tenant is not None:
                self._held[tenant] += 1
            handle.future = self._pool.submit(self._run_held, handle, key)
        return handle

    def _release(self, handle: Compile) -> None:
        """The tenant's hold on a thread ends (under the lock)."""
        if handle.tenant is not None:
            self._held[handle.tenant] -= 1
            if self._held[handle.tenant] <= 0:
                del self._held[handle.tenant]

    def _run_held(self, handle: Compile, key: tuple[str | None, str, str]) -> Grammar:
        """`_run`, the tenant holding the thread until it returns, deadline or not."""
        try:
            return self._run(handle, key)
        finally:
            with self._lock:
                self._release(handle)

    def outcome(self, handle: Compile) -> Grammar | None:
        """The compiled constraint, or None while it compiles; ValueError naming the field
        if it does not compile, admits no output, or has run past `max_compile_seconds`;
        CompilerBusy if it waited that long for a thread and never started."""
        assert handle.future is not None
        if handle.future.done() and not handle.future.cancelled():
            return handle.future.result()
        limit = self.max_compile_seconds
        if handle.started is None and limit is not None and (
                handle.future.cancelled() or time.monotonic() - handle.queued > limit):
            if handle.future.cancel():  # still queued: it never runs
                with self._lock:
                    self._release(handle)
                    self._inflight = {k: v for k, v in self._inflight.items()
                                      if v is not handle}
                raise CompilerBusy(
                    f"server overloaded: the output constraint waited over {limit:g}s for a "
                    f"compile thread (grammar_compile_threads={self.threads}, "
                    "all busy); retry later")
        if handle.timed_out or (limit is not None and handle.started is not None
                                and time.monotonic() - handle.started > limit):
            with self._lock:
                handle.timed_out = True
                self._too_slow[(handle.namespace, handle.kind, handle.text)] = limit or 0.0
                if len(self._too_slow) > MAX_CACHED_GRAMMARS:
                    self._too_slow.popitem(last=False)
                self._inflight = {k: v for k, v in self._inflight.items() if v is not handle}
            raise self._refuse(handle.kind)
        return None

    def compile(self, kind: str, text: str, namespace: str | None = None) -> Grammar:
        """`start` and wait for it (in the caller's thread: the Engine's callers)."""
        hit = self.cached(kind, text, namespace)
        if hit is not None:
            return hit
        handle = self.start(kind, text, namespace)
        while True:
            grammar = self.outcome(handle)
            if grammar is not None:
                return grammar
            try:
                assert handle.future is not None
                return handle.future.result(timeout=0.05)
            except FutureTimeout:
                continue

    @property
    def pending(self) -> int:
        """Compiles in flight (running or waiting for a thread)."""
        return len(self._inflight)

    def _refuse(self, kind: str) -> ValueError:
        return ValueError(
            f"sampling_params.{kind} did not compile within max_grammar_compile_seconds="
            f"{self.max_compile_seconds:g} (--max-grammar-compile-seconds): simplify it "
            "(large repetition counts such as {1,2000} are the usual cause)")

    def _run(self, handle: Compile, key: tuple[str | None, str, str]) -> Grammar:
        """In a pool thread: compile, check, cache."""
        try:
            try:
                compiler = self._compiler()
            except (ImportError, OSError, KeyError, ValueError) as e:
                raise ValueError(f"sampling_params.{handle.kind} is not available for this "
                                 f"model: {e!r} (needs xgrammar and the model's "
                                 "tokenizer.json)") from None
            handle.started = time.monotonic()  # xgrammar's one-off set-up is not counted
            start = time.perf_counter()
            grammar = Grammar(handle.kind, self._build(compiler, handle.kind, handle.text),
                              self.vocab_size, self.eos_ids, time.perf_counter() - start)
            if not GrammarState(grammar, ignore_eos=True).can_continue:
                raise ValueError(f"sampling_params.{handle.kind} admits no non-empty output "
                                 "in this vocabulary")
            with self._lock:
                if not handle.timed_out:
                    self._cache[key] = grammar
                    self._cache.move_to_end(key)
                    self.compiles += 1
                    if len(self._cache) > MAX_CACHED_GRAMMARS:
                        self._cache.popitem(last=False)
            return grammar
        finally:
            with self._lock:
                if self._inflight.get(key) is handle:
                    del self._inflight[key]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def _build(compiler: xgrammar.GrammarCompiler, kind: str, text: str
               ) -> xgrammar.CompiledGrammar:
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
