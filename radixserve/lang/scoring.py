"""`select`: score each choice by the runtime's input-token logprobs of prefix + choice.

Token boundaries must be exact, so this side tokenizes (with the runtime's own tokenizer)
and sends `input_ids`. A text prefix is not always a token prefix of prefix + choice: BPE
may merge across the boundary (`"Answer:"` + `" yes"` vs `"Answer: "` + `"yes"`). A
choice's tokens are therefore those of `encode(prefix + choice)` from the first position
where it departs from `encode(prefix)`: every choice is scored on exactly the tokens that
differ from the shared prompt, and the shared part is a cacheable token prefix.

Three calls at most, each one batch: commit the prefix (a zero-token request, so the
choices hit the radix cache), score all choices (`max_new_tokens=0`,
`logprob_start_len` = the earliest choice start; a request never takes the rows it must
score from the cache, so the rest is a cache hit), and, for the unconditional method, the
choices' tokens alone (no context) in one more batch.
"""

from __future__ import annotations

import math
import random
from typing import Any, Callable

from radixserve.lang.choices import ChoicesDecision, ChoicesSamplingMethod

Generate = Callable[..., Any]
"""`generate(prompt=... | input_ids=..., sampling_params=..., return_logprob=..., ...)`
of an Engine or a Client: one dict per prompt, a list for a batch."""

ZERO_TOKENS = {"max_new_tokens": 0, "temperature": 0.0}


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def choice_tokens(tokenizer: Any, prefix: str,
                  choices: list[str]) -> tuple[list[int], list[list[int]], list[int]]:
    """(prefix ids, prefix + choice ids per choice, where each choice's own tokens start)."""
    prefix_ids = tokenizer.encode(prefix) if prefix else []
    fulls = [tokenizer.encode(prefix + c) for c in choices]
    starts = [common_prefix_len(prefix_ids, f) for f in fulls]
    for choice, full, start in zip(choices, fulls, starts):
        if start >= len(full):
            raise ValueError(f"select: choice {choice!r} adds no token to the prompt")
        if start == 0:
            raise ValueError("select needs a non-empty prompt before the choices (the first "
                             "token of a prompt has no logprob)")
    return prefix_ids, fulls, starts


def score_choices(generate: Generate, tokenizer: Any, prefix: str, choices: list[str],
                  method: ChoicesSamplingMethod, temperature: float = 0.0,
                  commit_prefix: bool = True,
                  on_results: Callable[[list[dict]], None] | None = None) -> ChoicesDecision:
    if not choices:
        raise ValueError("select needs at least one choice")
    seen = on_results or (lambda results: None)
    prefix_ids, fulls, starts = choice_tokens(tokenizer, prefix, choices)
    if commit_prefix and len(prefix_ids) > 1:
        seen([generate(input_ids=prefix_ids, sampling_params=ZERO_TOKENS)])
    lo = min(starts)
    results = generate(input_ids=fulls, sampling_params=ZERO_TOKENS, return_logprob=True,
                       logprob_start_len=lo, return_text_in_logprobs=True)
    results = results if isinstance(results, list) else [results]
    seen(results)
    inputs = [r["meta_info"]["input_token_logprobs"][s - lo:] for r, s in zip(results, starts)]
    outputs = [r["meta_info"].get("output_token_logprobs", []) for r in results]
    normalized = [sum(row[0] for row in rows) / len(rows) for rows in inputs]
    unconditional = None
    if method.requires_unconditional_logprobs:
        alone = [[row[1] for row in rows] for rows in inputs]
        got = generate(input_ids=alone, sampling_params=ZERO_TOKENS, return_logprob=True,
                       logprob_start_len=0, return_text_in_logprobs=True)
        got = got if isinstance(got, list) else [got]
        seen(got)
        unconditional = [r["meta_info"]["input_token_logprobs"] for r in got]
    decision = method(choices=choices, normalized_prompt_logprobs=normalized,
                      input_token_logprobs=inputs, output_token_logprobs=outputs,
                      unconditional_token_logprobs=unconditional)
    if temperature > 1e-5:
        decision = _sample(decision, choices, temperature)
    return decision


def _sample(decision: ChoicesDecision, choices: list[str], temperature: float) -> ChoicesDecision:
    """select(temperature > 0): draw a choice with probability softmax(score / T)."""
    scores = decision.meta_info.get("scores")
    if scores is None:
        raise ValueError("this choices_method has no scores to sample from; use temperature=0")
    top = max(scores)
    weights = [math.exp((s - top) / temperature) for s in scores]
    decision.decision = random.choices(choices, weights=weights)[0]
    return decision
