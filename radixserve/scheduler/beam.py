"""Beam-search selection, decision for decision as transformers 5.24's `generate(num_beams=k,
do_sample=False)` makes it. Pure Python: no torch, no model, no KV; the caller runs the
beams and reports each one's best next tokens, this module says which beams go on.

What mirrors what in `transformers/generation/utils.py` (`GenerationMixin`):

- `BeamSearch.__init__`: the set-up in `_beam_search`. `beams_to_keep = max(2, 1 + n_eos) * k`
  candidates per step (`candidates_per_beam`); HF's k running beams start as k copies of the
  prompt scored `[0, -1e9, ..., -1e9]`, and the first `step` expands the one prompt beam into
  those same k virtual beams, so it decides exactly as HF does, also when the vocabulary has
  fewer than `beams_to_keep` tokens and HF's -1e9 copies get picked.
- `_top_k`: `_get_top_k_continuations` (the best `beams_to_keep` of all beams' `score + logprob`).
- `_next_running`: `_get_running_beams_for_next_iteration` (the best k candidates that did not
  hit a stopping criterion; a finished one is only pushed down by -1e9, so it can still run
  when fewer than k others exist, as in HF).
- `_update_finished`: `_update_finished_beams`. A candidate counts as a finished hypothesis
  only if it ranks within the top k of the `beams_to_keep` candidates and hits a stopping
  criterion (an EOS token, or the `max_new_tokens`-th token: there every top-k candidate is
  finished, EOS or not). The k best of old and new finished hypotheses are kept.
- `_early_stop_unsatisfied` and `done`: `_check_early_stop_heuristic` and
  `_beam_search_has_unfinished_sequences`.

Scores. A beam's running score is its cumulative log-probability (float32 sums, as HF's
tensors). A finished hypothesis scores (HF's `sequences_scores`)

    cum_logprob / generated_len ** length_penalty

where `generated_len` counts the generated tokens including the EOS token, not the prompt
(HF: `cur_len + 1 - decoder_prompt_len`). Early stopping, after each step with t tokens
generated, compares the best running beam's `cum / L ** length_penalty` with the worst of the
k finished hypotheses (only once all k slots hold one), where L = `max_new_tokens` if
`early_stopping == "never"` and `length_penalty > 0`, else L = t; `early_stopping=True` also
stops as soon as k hypotheses are finished and admits no more. The search is also over once
every candidate hits a stopping criterion (the `max_new_tokens` step).

All arithmetic is rounded to float32 as HF's CPU tensors are (`a / d` for a Python float d is
`f32(a / f32(d))`), so scores match bit for bit given the same float32 log-probabilities.
Exact ties are broken by (beam index, token id), lowest first; HF's `torch.topk` leaves the
order of equal values unspecified (on CPU it is neither stable nor index-ordered), so on exact
ties only the scores, not which of the tied tokens, can be promised to match.

`beam_width == 1`: HF's `generate(num_beams=1)` is greedy decoding, not `_beam_search`. One
beam with `early_stopping` forced to False is exactly greedy (it stops at the step where EOS
is the best token), so that is what width 1 does here; the score is reported as above.

EOS: pass the EOS ids together with any stop token ids as `eos_ids` (both stop a beam, and
both count in `beams_to_keep`, as entries of HF's `eos_token_id` list do); for `ignore_eos`
pass only the stop token ids (or nothing).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Collection, Literal, Sequence

EarlyStopping = bool | Literal["never"]

_NEG = -1.0e9
"""HF's stand-in for minus infinity: start score of the extra beams, finished-beam penalty."""

_F32 = struct.Struct("f")


def _f32(x: float) -> float:
    """`x` rounded to the nearest float32 (an add or divide of float32 values done in double
    and rounded once more is the correctly rounded float32 result)."""
    return _F32.unpack(_F32.pack(x))[0]


@dataclass(frozen=True)
class BeamCandidates:
    """What the worker reports for one running beam this step."""

    token_ids: Sequence[int]
    """Its best next tokens: `BeamSearch.candidates_per_beam` of them (the whole vocabulary
    if that is smaller), any order."""
    logprobs: Sequence[float]
    """log_softmax (float32) of the beam's last logits row at those tokens."""


@dataclass(frozen=True)
class BeamStep:
    """The decision for one step. When `done`, the lists are empty: nothing runs again."""

    parents: list[int]
    """For each new running beam, the index (into the previous running beams; 0 on the first
    step, which starts from the prompt alone) of the beam it extends."""
    tokens: list[int]
    """... and the token appended to it."""
    scores: list[float]
    """The new running beams' cumulative log-probabilities (HF's `running_beam_scores`)."""
    done: bool


@dataclass(frozen=True)
class BeamHypothesis:
    """A finished sequence."""

    output_ids: list[int]
    """The generated tokens (including the EOS token it stopped at), not the prompt."""
    score: float
    """`cum_logprob / len(output_ids) ** length_penalty`: HF's `sequences_scores`."""
    cum_logprob: float
    finish_reason: Literal["stop", "length"]
    """"length" when it reached `max_new_tokens` (even if on an EOS token, as `check_finish`
    reports length first), else "stop"."""
    matched: int | None
    """The EOS / stop token id it stopped at, for "stop"."""


@dataclass(frozen=True)
class _Cand:
    score: float  # cumulative float32 log-probability
    beam: int  # index of the (virtual, on the first step) beam it extends
    token: int


@dataclass(frozen=True)
class _Slot:
    """One of HF's k finished-beam slots: `score` (length-normalised, with HF's penalties)
    and, if `finished` (HF's `is_sent_finished`), the hypothesis it holds."""

    score: float
    finished: bool
    hyp: BeamHypothesis | None = None


class BeamSearch:
    """The selection state of one beam search. Call `step` once per generated token with every
    running beam's candidates until it says `done`, then `finish`."""

    def __init__(self, beam_width: int, max_new_tokens: int, length_penalty: float = 1.0,
                 early_stopping: EarlyStopping = False,
                 eos_ids: Collection[int] = frozenset()) -> None:
        if beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {beam_width}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not (early_stopping is True or early_stopping is False or early_stopping == "never"):
            raise ValueError(
                f"early_stopping must be True, False or 'never', got {early_stopping!r}")
        if not math.isfinite(length_penalty):
            raise ValueError(f"length_penalty must be finite, got {length_penalty}")
        self.beam_width = beam_width
        self.max_new_tokens = max_new_tokens
        self.length_penalty = float(length_penalty)
        # generate(num_beams=1) is greedy search; one beam without early stopping is exactly that.
        self.early_stopping: EarlyStopping = early_stopping if beam_width > 1 else False
        self.eos_ids = frozenset(eos_ids)
        self._k = beam_width
        self._n_keep = max(2, 1 + len(self.eos_ids)) * beam_width
        self._running: list[tuple[int, ...]] = [()]
        self._running_scores: list[float] = [0.0]
        self._slots = [_Slot(_NEG, False)] * beam_width
        self._generated = 0
        self._improvable = True  # HF's is_early_stop_heuristic_unsatisfied
        self._done = False

    @property
    def candidates_per_beam(self) -> int:
        """How many best tokens the worker must report per beam (HF's `beams_to_keep`)."""
        return self._n_keep

    @property
    def done(self) -> bool:
        return self._done

    @property
    def num_generated(self) -> int:
        """Tokens generated by every running beam so far (steps taken)."""
        return self._generated

    @property
    def running(self) -> list[tuple[int, ...]]:
        """The running beams' generated tokens, in the order `step` expects their candidates."""
        return list(self._running)

    @property
    def running_scores(self) -> list[float]:
        return list(self._running_scores)

    def step(self, candidates: Sequence[BeamCandidates]) -> BeamStep:
        """Extend the running beams by one token. `candidates[i]` is for `running[i]` (one
        entry, the prompt's, on the first step)."""
        if self._done:
            raise RuntimeError("beam search is done")
        if len(candidates) != len(self._running):
            raise ValueError(
                f"{len(candidates)} candidate lists for {len(self._running)} running beams")
        for c in candidates:
            if len(c.token_ids) != len(c.logprobs) or not c.token_ids:
                raise ValueError("each beam needs as many token ids as logprobs, and at least one")
        if self._generated == 0:
            # HF's k copies of the prompt, scored [0, -1e9, ...]: virtual beams 1..k-1 extend
            # the prompt too but only win when the prompt has fewer than beams_to_keep tokens.
            beam_scores = [0.0] + [_NEG] * (self._k - 1)
            cand_lists: Sequence[BeamCandidates] = [candidates[0]] * self._k
            parent_of = [0] * self._k
        else:
            beam_scores, cand_lists = self._running_scores, candidates
            parent_of = list(range(self._k))
        top = self._top_k(beam_scores, cand_lists)
        last = self._generated + 1 == self.max_new_tokens
        hits = [last or c.token in self.eos_ids for c in top]
        nxt = self._next_running(top, hits)
        self._update_finished(top, hits, [self._running[parent_of[c.beam]] for c in top], last)

        self._running = [self._running[parent_of[top[i].beam]] + (top[i].token,) for i in nxt]
        self._running_scores = [_f32(top[i].score + _NEG) if hits[i] else top[i].score for i in nxt]
        self._generated += 1
        self._improvable = self._improvable and self._early_stop_unsatisfied()
        all_finished = all(s.finished for s in self._slots)
        self._done = not (self._improvable and not (all_finished and self.early_stopping is True)
                          and not all(hits))
        if self._done:
            return BeamStep([], [], [], True)
        return BeamStep(parents=[parent_of[top[i].beam] for i in nxt],
                        tokens=[top[i].token for i in nxt],
                        scores=list(self._running_scores), done=False)

    def finish(self) -> list[BeamHypothesis]:
        """The finished hypotheses, best first: HF's `sequences`/`sequences_scores` for
        `num_return_sequences = beam_width` once `done`. (A slot HF would fill with a padded
        never-finished placeholder, possible only with a vocabulary smaller than
        `candidates_per_beam`, is left out.) Before `done`, the ones finished so far."""
        return [s.hyp for s in self._slots if s.finished and s.hyp is not None]

    # -- HF's helpers ------------------------------------------------------------------------

    def _top_k(self, beam_scores: Sequence[float],
               cand_lists: Sequence[BeamCandidates]) -> list[_Cand]:
        """`_get_top_k_continuations`: the best `beams_to_keep` of every beam's score + logprob."""
        flat = [_Cand(_f32(s + lp), b, int(t))
                for b, (s, c) in enumerate(zip(beam_scores, cand_lists))
                for t, lp in zip(c.token_ids, c.logprobs)]
        flat.sort(key=lambda c: (-c.score, c.beam, c.token))
        return flat[:self._n_keep]

    def _next_running(self, top: list[_Cand], hits: list[bool]) -> list[int]:
        """`_get_running_beams_for_next_iteration`: indices into `top` of the k best after
        pushing the ones that hit a stopping criterion down by 1e9."""
        penalised = [_f32(c.score + _NEG) if h else c.score for c, h in zip(top, hits)]
        order = sorted(range(len(top)), key=lambda i: -penalised[i])  # stable: rank breaks ties
        return order[:self._k]

    def _update_finished(self, top: list[_Cand], hits: list[bool], prefixes: list[tuple[int, ...]],
                         last: bool) -> None:
        """`_update_finished_beams`: the top-k candidates that hit a stopping criterion join
        the finished slots, normalised by their generated length; the best k slots stay.
        (HF's other two penalties, for full slots with early_stopping=True and for a satisfied
        early-stop heuristic, never apply: then the search was already done.)"""
        n = self._generated + 1
        denom = _f32(n ** self.length_penalty)
        new: list[_Slot] = []
        for i, (c, h) in enumerate(zip(top, hits)):
            norm = _f32(c.score / denom)
            if i < self._k and h:
                ids = list(prefixes[i]) + [c.token]
                reason: Literal["stop", "length"] = "length" if last else "stop"
                hyp = BeamHypothesis(ids, norm, c.score, reason, None if last else c.token)
                new.append(_Slot(norm, True, hyp))
            else:
                new.append(_Slot(_f32(norm + _NEG), False))
        merged = self._slots + new
        # stable: on a tie the old slots come first, then the new ones by rank
        order = sorted(range(len(merged)), key=lambda i: -merged[i].score)
        self._slots = [merged[i] for i in order[:self._k]]

    def _early_stop_unsatisfied(self) -> bool:
        """`_check_early_stop_heuristic` (before the stickiness): can the best running beam
        still beat the worst finished hypothesis? True while any slot is unfinished."""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            length = self.max_new_tokens
        else:
            length = self._generated
        best = _f32(self._running_scores[0] / _f32(length ** self.length_penalty))
        worst = min(s.score for s in self._slots)
        return any(best > (worst if s.finished else _NEG) for s in self._slots)
