"""The greedy cases: chat-formatted prompts (several share a long system prompt, so the radix
cache and its eviction are exercised) and their transformers references, each cut before its
first near-tie so that every completed greedy answer must equal it exactly."""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TIE_GAP = 1e-4
"""As tests/hf_reference.py: a greedy choice between logits closer than this may flip."""

# -- the greedy cases --------------------------------------------------------------------
SYSTEM_A = (
    "You are the help desk of a regional railway company. Answer in a friendly tone and "
    "keep every answer short. Trains run every thirty minutes between six in the morning "
    "and midnight on weekdays, and every hour on weekends. A single ticket costs four euros "
    "within one zone and two euros more for each further zone. Children under six travel "
    "free; pupils and students pay half price with a valid card. Bicycles may be taken on "
    "board outside the rush hours, from nine to four and after seven in the evening, with "
    "a bicycle ticket of three euros. Dogs travel free if they are small enough to sit in "
    "a basket; larger dogs need a child's ticket and a muzzle. Lost property is kept for "
    "three months at the central station, open from eight to eight. Delays over an hour "
    "are refunded at a quarter of the fare, delays over two hours at half. Season tickets "
    "are sold by the month or by the year; the yearly ticket costs ten monthly ones. "
) * 2
SYSTEM_B = (
    "You are a careful cooking assistant. Give recipes as short numbered steps, name the "
    "quantities in grams and millilitres, and mention the oven temperature in Celsius. "
    "Never suggest raw eggs for children or pregnant people. When a question is not about "
    "food, say politely that you only help with cooking. Prefer seasonal vegetables, and "
    "offer a vegetarian variant whenever the recipe contains meat or fish. "
)
CASES: list[tuple[str | None, str, int]] = [
    (SYSTEM_A, "How much is a ticket for three zones?", 40),
    (SYSTEM_A, "Can I take my bicycle at eight in the morning?", 24),
    (SYSTEM_A, "My train was ninety minutes late. What do I get back?", 40),
    (SYSTEM_A, "Does my large dog need a ticket?", 16),
    (SYSTEM_A, "Where do I find a lost umbrella?", 32),
    (SYSTEM_B, "How do I make a simple tomato soup?", 40),
    (SYSTEM_B, "What can I bake with three apples?", 24),
    (SYSTEM_B, "Who won the football match yesterday?", 16),
    (None, "What is the capital of France?", 16),
    (None, "Write a haiku about the sea.", 32),
    (None, "List three prime numbers.", 12),
    (None, "Explain photosynthesis in one sentence.", 40),
]
"""(system prompt, question, desired length): the length is cut at the reference's first
near-tie."""


@dataclass(frozen=True)
class Case:
    name: str
    messages: list[dict[str, str]]
    text: str
    """The prompt as the chat template renders it (what /v1/chat/completions sends)."""
    ids: list[int]
    expected: list[int]
    answer: str
    """`expected` decoded as the server decodes (skip special tokens)."""
    desired: int

    @property
    def params(self) -> dict[str, Any]:
        return {"max_new_tokens": len(self.expected), "temperature": 0, "ignore_eos": True}


def build_cases(model_dir: Path, tokenizer: Any) -> tuple[list[Case], dict[str, Any]]:
    """Render the prompts as the chat route does and compute their greedy references with
    transformers, each cut before its first near-tie."""
    from radixserve.chat.prompt import render
    from tests.hf_reference import HFReference

    hf = HFReference(model_dir)
    cases, cut = [], {}
    for i, (system, question, desired) in enumerate(CASES):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": question}]
        text = render(tokenizer, messages, None)
        ids = tokenizer.encode(text)
        ref = hf.greedy(ids, desired)
        length = next((k for k, gap in enumerate(ref.gaps) if gap < TIE_GAP), desired)
        name = f"case{i}"
        if length < desired:
            cut[name] = length
        if length < 4:  # too short to say anything; a near-tie at once
            continue
        expected = ref.tokens[:length]
        text_of = tokenizer.decode(expected, skip_special_tokens=True,
                                   spaces_between_special_tokens=True)
        cases.append(Case(name, messages, text, ids, expected, text_of, desired))
    del hf
    gc.collect()
    info = {"cases": len(cases), "cut_at_near_tie": cut,
            "prompt_tokens": [len(c.ids) for c in cases],
            "output_tokens": [len(c.expected) for c in cases]}
    return cases, info
