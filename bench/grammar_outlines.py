"""bench/grammar.py's outlines-core side: the adapter that uses it as the runtime once did
(a DFA index per pattern, a packed bitmap per state), and the timer both sides share."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from radixserve.scheduler.grammar_compiler import token_bytes


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


class Outlines:
    """outlines-core as the runtime used it for regexes: a token-level DFA index per pattern
    (JSON schemas through its regex translation), and per state a packed bitmap of the
    allowed tokens, EOS re-added in accepting states."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_ids: list[int]) -> None:
        from outlines_core import Vocabulary

        spelled = token_bytes(json.loads((model_dir / "tokenizer.json").read_text()))
        by_bytes: dict[bytes, list[int]] = {}
        for i, raw in spelled.items():
            if i not in eos_ids and raw:
                by_bytes.setdefault(raw, []).append(i)
        self.vocab_size, self.eos_ids = vocab_size, eos_ids
        self.vocabulary = Vocabulary(eos_ids[0], by_bytes)

    def compile(self, kind: str, text: str) -> Any:
        from outlines_core import Index
        from outlines_core.json_schema import build_regex_from_schema

        if kind == "json_schema":
            text = build_regex_from_schema(text, whitespace_pattern=r"[ ]?")
        return Index(text, self.vocabulary)

    def mask(self, index: Any, state: int) -> bytes:
        bits = np.zeros(-(-self.vocab_size // 8) * 8, dtype=bool)
        allowed = [t for t in index.get_allowed_tokens(state) or [] if t not in self.eos_ids]
        bits[allowed] = True
        if index.is_final_state(state):
            bits[self.eos_ids] = True
        return np.packbits(bits, bitorder="little").tobytes()

    def walk(self, index: Any, tokens: list[int]) -> tuple[list[float], bool]:
        """Seconds per step (the mask for each next token), and whether the output matched."""
        times, state = [], index.get_initial_state()
        times.append(timed(lambda: self.mask(index, state))[1])
        for token in tokens:
            start = time.perf_counter()
            state = index.get_next_state(state, token)
            if state is None:
                return times, False
            self.mask(index, state)
            times.append(time.perf_counter() - start)
        return times[:-1], index.is_final_state(state)
