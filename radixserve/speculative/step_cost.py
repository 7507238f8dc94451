"""What a step costs for the tokens it runs, learnt from the steps themselves, and
so what a draft token must be worth to pay for its row.

A forward reads every weight once whatever its token count, and computes per token:
`seconds = fixed + per_token * tokens`. At batch 1 `fixed` dominates and a draft row is
nearly free; at batch 64 on a CPU the rows dominate and a draft row costs about what a
real token does, so only a draft that is almost surely accepted pays. The two terms
depend on the machine, the weights' format and what else shares the cores, so they are
fitted to the steps this scheduler has timed (exponentially weighted least squares:
recent steps count most), not assumed.
"""

from __future__ import annotations

DECAY = 0.98
"""Weight kept by each older step per new one (~50 steps of memory)."""
MIN_STEPS = 8.0
MIN_SPREAD = 1.0
"""Before this many (weighted) steps, or while their token counts hardly differ (variance
in tokens², e.g. a steady batch that drafts nothing), the fit is unidentifiable: the last
one stands (at first none, and drafts are taken as free)."""


class StepCost:
    """An online fit of a step's seconds in its token count (no torch, no sockets)."""

    def __init__(self) -> None:
        self._w = self._n = self._nn = self._t = self._nt = 0.0
        self.fixed = self.per_token = 0.0
        """The fit's terms in seconds (0 until the steps identify them)."""

    def observe(self, tokens: int, seconds: float) -> None:
        """A step of `tokens` query rows took `seconds` in the worker."""
        d = DECAY
        self._w = d * self._w + 1.0
        self._n = d * self._n + tokens
        self._nn = d * self._nn + tokens * tokens
        self._t = d * self._t + seconds
        self._nt = d * self._nt + tokens * seconds
        mean_n, mean_t = self._n / self._w, self._t / self._w
        spread = self._nn / self._w - mean_n * mean_n
        if self._w < MIN_STEPS or spread < MIN_SPREAD:
            return
        slope = (self._nt / self._w - mean_n * mean_t) / spread
        # Timing noise can tip either term below zero; neither is in the model.
        self.per_token = max(slope, 0.0)
        self.fixed = max(mean_t - self.per_token * mean_n, 0.0)

    def break_even(self, tokens: int) -> float:
        """The chance of acceptance at which one more draft row pays in a step that runs
        `tokens` tokens otherwise: a row adds `per_token` to a step that yields about
        `tokens` tokens, so it must yield `per_token * tokens / seconds(tokens)` of a
        token. 0 while nothing is known (or drafts really are free), near 1 when compute
        bound."""
        seconds = self.fixed + self.per_token * tokens
        return self.per_token * tokens / seconds if seconds > 0 else 0.0
