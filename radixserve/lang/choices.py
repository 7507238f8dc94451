"""How `select` turns the choices' token logprobs into a decision.

Each method gets, per choice, the logprobs of the choice's own tokens given the prompt
(`input_token_logprobs`, `[logprob, token_id, text]` rows) and their mean
(`normalized_prompt_logprobs`); the unconditional method also gets the same tokens scored
with no prompt at all. The three methods and their names are SGLang's:

- token_length_normalized (default): highest mean token logprob, so long choices are not
  penalised for having more tokens;
- greedy_token_selection: compare the choices token by token, keep those with the best
  logprob at each position until one is left (a shorter choice is padded with its mean);
- unconditional_likelihood_normalized: highest mean of (conditional - unconditional)
  logprob per token, which discounts choices that are likely whatever the question (the
  first token's unconditional logprob, which has no context, counts as 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


def _first_argmax(values: list[float]) -> int:
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


class ChoicesSamplingMethod:
    """Base of the select methods; `requires_unconditional_logprobs` asks the backend
    for the extra context-free scoring pass."""

    requires_unconditional_logprobs = False

    def scores(self, input_token_logprobs: list[list[Any]], normalized: list[float],
               unconditional: list[list[Any]] | None) -> list[float] | None:
        """One scalar per choice (higher is better), or None where the method has none."""
        return normalized

    def __call__(self, *, choices: list[str], normalized_prompt_logprobs: list[float],
                 input_token_logprobs: list[list[Any]], output_token_logprobs: list[list[Any]],
                 unconditional_token_logprobs: list[list[Any]] | None = None) -> ChoicesDecision:
        scores = self.scores(input_token_logprobs, normalized_prompt_logprobs,
                             unconditional_token_logprobs)
        meta: dict[str, Any] = {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
        }
        best = self.pick(input_token_logprobs, scores, meta)
        meta["scores"] = scores
        return ChoicesDecision(choices[best], meta)

    def pick(self, input_token_logprobs: list[list[Any]], scores: list[float] | None,
             meta: dict[str, Any]) -> int:
        assert scores is not None
        return _first_argmax(scores)

    def __repr__(self) -> str:
        return type(self).__name__


class TokenLengthNormalized(ChoicesSamplingMethod):
    pass


class GreedyTokenSelection(ChoicesSamplingMethod):
    def scores(self, input_token_logprobs: list[list[Any]], normalized: list[float],
               unconditional: list[list[Any]] | None) -> list[float] | None:
        return None

    def pick(self, input_token_logprobs: list[list[Any]], scores: list[float] | None,
             meta: dict[str, Any]) -> int:
        rows = [[row[0] for row in option] for option in input_token_logprobs]
        width = max(len(r) for r in rows)
        matrix = [r + [_mean(r) if r else float("nan")] * (width - len(r)) for r in rows]
        meta["greedy_logprob_matrix"] = matrix
        alive = list(range(len(matrix)))
        for j in range(width):
            best = max(matrix[i][j] for i in alive)
            alive = [i for i in alive if matrix[i][j] == best]
            if len(alive) == 1:
                break
        return alive[0]


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    requires_unconditional_logprobs = True

    def scores(self, input_token_logprobs: list[list[Any]], normalized: list[float],
               unconditional: list[list[Any]] | None) -> list[float] | None:
        if unconditional is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional logprobs")
        out = []
        for cond, uncond in zip(input_token_logprobs, unconditional):
            if len(cond) != len(uncond):
                raise ValueError("conditional and unconditional logprobs differ in length")
            base = [row[0] or 0.0 for row in uncond]  # the first has no context: None -> 0
            out.append(_mean([c[0] - u for c, u in zip(cond, base)]))
        return out

    def __call__(self, **kwargs: Any) -> ChoicesDecision:
        decision = super().__call__(**kwargs)
        decision.meta_info["unconditional_token_logprobs"] = kwargs.get(
            "unconditional_token_logprobs")
        decision.meta_info["normalized_unconditional_prompt_logprobs"] = \
            decision.meta_info["scores"]
        return decision


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
