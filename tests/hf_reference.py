"""The correctness reference: Hugging Face transformers, fp32, CPU, greedy.

`greedy(ids, n)` returns the reference tokens with the top-2 logit gap at every step, so
that a comparison can tell a real bug from a near-tie that floating-point order may flip.
Results are memoised: many engine configurations compare against the same reference.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import torch

TIE_GAP = 1e-4
"""A greedy choice between two logits closer than this may flip between implementations."""


@dataclass(frozen=True)
class Reference:
    tokens: list[int]
    gaps: list[float]


@dataclass(frozen=True)
class _Run:
    """A memoised greedy run: its tokens, their gaps, and whether it stopped at an EOS."""

    tokens: list[int]
    gaps: list[float]
    ended: bool


class HFReference:
    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, local_files_only=True).eval()
        self._memo: dict[tuple, _Run] = {}
        """Per (prompt, eos): the longest greedy run made so far."""
        # transformers 5 renamed the forward's `past_key_values` argument to `cache`.
        params = inspect.signature(type(self.model).forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @torch.inference_mode()
    def greedy(self, ids: list[int], max_new_tokens: int, eos: set[int] | None = None) -> Reference:
        """The first `max_new_tokens` greedy tokens (fewer where one is in `eos`). Greedy
        decoding's first n tokens are those of any longer run: a memoised longer run (or
        one that ended at `eos`) answers a shorter request."""
        key = (tuple(ids), frozenset(eos or ()))
        known = self._memo.get(key)
        if known is not None and (len(known.tokens) >= max_new_tokens or known.ended):
            return Reference(known.tokens[:max_new_tokens], known.gaps[:max_new_tokens])
        out = self.model(torch.tensor([ids]), use_cache=True)
        tokens: list[int] = []
        gaps: list[float] = []
        ended = False
        while len(tokens) < max_new_tokens and not ended:
            if tokens:  # the last token is fed only when its successor is wanted
                out = self.model(torch.tensor([tokens[-1:]]), use_cache=True,
                                 **{self._cache_arg: out.past_key_values})
            logits = out.logits[0, -1]
            top2 = logits.topk(2).values
            tokens.append(int(logits.argmax()))
            gaps.append(float(top2[0] - top2[1]))
            ended = bool(eos) and tokens[-1] in eos
        self._memo[key] = _Run(tokens, gaps, ended)
        return Reference(tokens, gaps)

    @torch.inference_mode()
    def generate(self, ids: list[int], max_new_tokens: int, **options) -> Reference:
        """transformers' own greedy `generate` with its logits processors (`options`, such
        as `min_new_tokens`); the gaps are those of the processed scores it picked from."""
        out = self.model.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens,
            output_scores=True, return_dict_in_generate=True, **options)
        tokens = out.sequences[0, len(ids):].tolist()
        gaps = [float(top[0] - top[1]) for top in (s[0].topk(2).values for s in out.scores)]
        return Reference(tokens[:len(gaps)], gaps)

    @torch.inference_mode()
    def beam_search(self, ids: list[int], width: int, max_new_tokens: int,
                    **options) -> list[tuple[list[int], float]]:
        """transformers' own beam search: the `width` beams best first, as (generated
        tokens up to and including EOS, `sequences_scores`)."""
        out = self.model.generate(
            torch.tensor([ids]), num_beams=width, do_sample=False, num_return_sequences=width,
            max_new_tokens=max_new_tokens, output_scores=True, return_dict_in_generate=True,
            **options)
        eos = set(self.model.generation_config.eos_token_id or []) if isinstance(
            self.model.generation_config.eos_token_id, list) else {
            self.model.generation_config.eos_token_id}
        beams = []
        for seq, score in zip(out.sequences, out.sequences_scores):
            tokens = seq[len(ids):].tolist()
            ends = [i for i, t in enumerate(tokens) if t in eos]
            beams.append((tokens[:ends[0] + 1] if ends else tokens, float(score)))
        return beams

    @torch.inference_mode()
    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """`[len(ids), vocab]` log-softmax of the logits at every position."""
        return torch.log_softmax(self.model(torch.tensor([ids])).logits[0].float(), dim=-1)


def assert_matches_reference(got: list[int], ref: Reference, what: str = "") -> None:
    """Token for token, except after a step where the reference itself was a near-tie."""
    for i, (a, b) in enumerate(zip(got, ref.tokens)):
        if a != b:
            assert ref.gaps[i] < TIE_GAP, (
                f"{what}: token {i} is {a}, reference {b} (top-2 gap {ref.gaps[i]:.2e}); "
                f"got {got}, reference {ref.tokens}")
            return
    assert len(got) == len(ref.tokens), f"{what}: {len(got)} tokens, reference {len(ref.tokens)}"
