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


class HFReference:
    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, local_files_only=True).eval()
        self._memo: dict[tuple, Reference] = {}
        # transformers 5 renamed the forward's `past_key_values` argument to `cache`.
        params = inspect.signature(type(self.model).forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @torch.inference_mode()
    def greedy(self, ids: list[int], max_new_tokens: int, eos: set[int] | None = None) -> Reference:
        key = (tuple(ids), max_new_tokens, frozenset(eos or ()))
        if key in self._memo:
            return self._memo[key]
        out = self.model(torch.tensor([ids]), use_cache=True)
        tokens, gaps = [], []
        for _ in range(max_new_tokens):
            logits = out.logits[0, -1]
            top2 = logits.topk(2).values
            token = int(logits.argmax())
            tokens.append(token)
            gaps.append(float(top2[0] - top2[1]))
            if eos and token in eos:
                break
            out = self.model(torch.tensor([[token]]), use_cache=True,
                             **{self._cache_arg: out.past_key_values})
        self._memo[key] = Reference(tokens, gaps)
        return self._memo[key]

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
