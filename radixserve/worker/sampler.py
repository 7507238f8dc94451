"""Turn each sequence's logits into its next token, on the logits' device.

Penalties apply first, then `logit_bias`, then the grammar masks (tokens a constrained
request may not take get -inf, so greedy and sampled rows alike pick an allowed token), then
temperature, then the top-k / top-p / min-p filters, all on a copy: the caller's logits
give the output logprobs, which stay the model's. Greedy rows take the argmax. The masks
also keep EOS and the stop tokens out until a request's `min_new_tokens` are out.

A step whose rows are all greedy with nothing that changes their logits is one argmax,
and copies nothing. Any other step's parameters cross to the device once
(`SamplingTensors.of`), with host flags for
what any row asks (so no device `.any()` decides a branch), and nothing in a step reads a
device value back: the caller's one copy of the sampled ids is the step's only sync.
Each sampling row draws from a counter-based RNG, a hash of (request seed, output index)
computed on the device, so a seeded request gets the same tokens whatever batch it runs
in, and after a retraction it resumes exactly where it stopped. For the same reason every
filter is a per-row threshold on the row's own probabilities and the draw searches them in
vocabulary order: a row's token never depends on which path its batch took.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from radixserve.messages import SeqSampling
from radixserve.messages.sampling import is_greedy
from radixserve.worker.staging import to_device
from radixserve.worker.top_p import top_p_floors

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _int64(x: int) -> int:
    """The low 64 bits of `x` as a signed int64 (how torch holds them)."""
    return ((x & _MASK64) ^ (1 << 63)) - (1 << 63)


@dataclass(frozen=True)
class DrawTensors:
    """What a step's draw needs, per row (`[S]`), on the device; greedy rows carry neutral
    values (their token is the argmax), and the host's knowledge of the values picks the
    work: deciding from the device tensors would sync per decision."""

    greedy: torch.Tensor
    """bool."""
    temperature: torch.Tensor
    """float32; 1 on greedy rows, so their (unused) draw stays finite."""
    top_p: torch.Tensor
    """float32; 1: no limit."""
    min_p: torch.Tensor
    """float32; 0: no limit."""
    top_k: torch.Tensor
    """int64; 0: no limit."""
    seeds: torch.Tensor
    """int64: each request's seed, its low 64 bits."""
    steps: torch.Tensor
    """int64: each row's output index, the RNG's counter."""
    top_k_rows: torch.Tensor | None
    """int64: the sampled rows with a top-k (None: no row has one), which alone pay for
    the `topk`; likewise `top_p_rows` for the sort."""
    top_p_rows: torch.Tensor | None
    max_top_k: int
    """The largest top-k (0: no row has one): the width of one `topk`."""
    any_min_p: bool

    @classmethod
    def of(cls, params: list[SeqSampling], live: np.ndarray,
           device: torch.device) -> DrawTensors:
        """Pack `params` (`live`: the rows that sample) onto `device` in two copies, one
        for the floats and one for the integers."""
        n = len(params)
        floats = np.array([(p.temperature, p.top_p, p.min_p) for p in params],
                          dtype=np.float32).reshape(n, 3).T.copy()
        floats[:, ~live] = np.array([[1.0], [1.0], [0.0]])  # greedy rows: neutral
        top_k = np.array([p.top_k for p in params], dtype=np.int64).clip(min=0) * live
        k_rows, p_rows = np.flatnonzero(top_k), np.flatnonzero(floats[1] < 1)
        seeds = np.array([p.seed & _MASK64 for p in params], dtype=np.uint64).view(np.int64)
        ints = np.concatenate([live, top_k, seeds, [p.step for p in params], k_rows, p_rows],
                              dtype=np.int64)
        temperature, top_p, min_p = to_device(floats, device, torch.float32)
        packed = to_device(ints, device)
        live_t, top_k_t, seeds_t, steps = packed[:4 * n].view(4, n)
        return cls(greedy=live_t == 0, temperature=temperature, top_p=top_p, min_p=min_p,
                   top_k=top_k_t, seeds=seeds_t, steps=steps,
                   top_k_rows=packed[4 * n:4 * n + len(k_rows)] if len(k_rows) else None,
                   top_p_rows=packed[4 * n + len(k_rows):] if len(p_rows) else None,
                   max_top_k=int(top_k.max(initial=0)), any_min_p=bool((floats[2] > 0).any()))


@dataclass(frozen=True)
class SamplingTensors:
    """One step's sampling parameters, packed once on the host from the Python values
    and copied to the device, with the flags that say which steps any row needs."""

    draw: DrawTensors | None
    """None: every row is greedy, and the step is one argmax."""
    counted: tuple[torch.Tensor, torch.Tensor] | None
    """Frequency / presence penalties, one entry per (row, token) in the row's outputs:
    `[2, E]` rows and tokens, `[3, E]` the row's frequency penalty, the count, the row's
    presence penalty."""
    repeated: tuple[torch.Tensor, torch.Tensor] | None
    """The repetition penalty, one entry per (row, token) in the row's prompt and outputs:
    `[2, E]` rows and tokens, `[E]` the row's penalty."""
    bias: bool
    masks: bool

    @classmethod
    def of(cls, params: list[SeqSampling], device: torch.device) -> SamplingTensors:
        """Pack `params` onto `device`: two copies for the draw where a row samples, two
        for each penalty kind a row has."""
        live = np.array([not is_greedy(p.temperature, p.top_k) for p in params], dtype=bool)
        return cls(draw=DrawTensors.of(params, live, device) if live.any() else None,
                   counted=_counted(params, device), repeated=_repeated(params, device),
                   bias=any(p.logit_bias is not None for p in params),
                   masks=any(p.allowed_mask is not None or p.banned_ids for p in params))


def _entries(rows: list[int],
             ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct (row, token) pairs of each row's `ids`, and how often each occurs,
    in one numpy pass over the rows' tokens concatenated."""
    keys = np.concatenate([np.asarray(t, dtype=np.int64) + (row << 32)
                           for row, t in zip(rows, ids)])
    keys, counts = np.unique(keys, return_counts=True)
    return keys >> 32, keys & 0xFFFFFFFF, counts


def _counted(params: list[SeqSampling],
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`SamplingTensors.counted`, or None when no row has outputs to penalise."""
    rows = [i for i, p in enumerate(params)
            if (p.frequency_penalty or p.presence_penalty) and p.output_ids]
    if not rows:
        return None
    row, token, count = _entries(rows, [params[i].output_ids or [] for i in rows])
    frequency = np.array([p.frequency_penalty for p in params], dtype=np.float32)
    presence = np.array([p.presence_penalty for p in params], dtype=np.float32)
    amounts = np.stack([frequency[row], count.astype(np.float32), presence[row]])
    return (to_device(np.stack([row, token]), device),
            to_device(amounts, device, torch.float32))


def _repeated(params: list[SeqSampling],
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`SamplingTensors.repeated`, or None when no row has a repetition penalty on tokens."""
    rows = [i for i, p in enumerate(params)
            if p.repetition_penalty != 1.0 and (p.prompt_ids or p.output_ids)]
    if not rows:
        return None
    seen = [(params[i].prompt_ids or []) + (params[i].output_ids or []) for i in rows]
    row, token, _ = _entries(rows, seen)
    penalty = np.array([p.repetition_penalty for p in params], dtype=np.float32)
    return (to_device(np.stack([row, token]), device),
            to_device(penalty[row], device, torch.float32))


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> None:
    """In place: OpenAI frequency/presence penalties over the outputs, and the Hugging Face
    repetition penalty over prompt and outputs, each as one scatter over the step's
    (row, token) entries."""
    if t.counted is not None:
        (row, token), (frequency, count, presence) = t.counted
        logits.index_put_((row, token), -(frequency * count + presence), accumulate=True)
    if t.repeated is not None:
        (row, token), penalty = t.repeated
        picked = logits[row, token]
        logits[row, token] = torch.where(picked > 0, picked / penalty, picked * penalty)


def apply_logit_bias(logits: torch.Tensor, params: list[SeqSampling]) -> None:
    """In place: each row's `logit_bias` values added to its tokens' logits, in one
    scatter; the packed bytes become tensors without a Python list per entry."""
    rows = [(row, p.logit_bias) for row, p in enumerate(params) if p.logit_bias is not None]
    ids = np.concatenate([np.frombuffer(b.ids, dtype=np.int32) for _, b in rows])
    values = np.concatenate([np.frombuffer(b.values, dtype=np.float32) for _, b in rows])
    counts = [len(b.ids) // 4 for _, b in rows]
    row_ids = np.repeat([row for row, _ in rows], counts)
    index = to_device(np.stack([row_ids, ids]), logits.device)
    logits.index_put_(tuple(index), to_device(values, logits.device, torch.float32).to(
        logits.dtype), accumulate=True)


def filter_probs(probs: torch.Tensor, t: DrawTensors) -> torch.Tensor:
    """Zero out what top-k, top-p and min-p exclude, per row (unnormalised result).

    Each filter is a floor on the row's probabilities (its k-th largest, the smallest of
    the top-p prefix, min-p times the largest), and a token below the highest floor goes.
    A floor is found from the row alone, on only the rows that ask for it (a `topk` of
    the widest top-k, `top_p.top_p_floors` for top-p): a row keeps the same tokens in
    any batch, and the cost follows the rows that filter. Top-p keeps a token while the
    mass strictly before it is below top_p (the first always stays)."""
    if t.top_k_rows is None and t.top_p_rows is None and not t.any_min_p:
        return probs
    vocab = probs.shape[-1]
    floor = torch.zeros_like(probs[:, 0])
    if t.top_k_rows is not None:
        rows = t.top_k_rows
        width = min(t.max_top_k, vocab)
        k = t.top_k[rows].clamp(max=width)[:, None] - 1
        kth = probs[rows].topk(width, dim=-1).values.gather(-1, k)[:, 0]
        floor.index_copy_(0, rows, kth)
    if t.top_p_rows is not None:
        rows = t.top_p_rows
        last = top_p_floors(probs[rows], t.top_p[rows])
        floor.index_copy_(0, rows, torch.maximum(floor[rows], last))
    if t.any_min_p:
        floor = torch.maximum(floor, t.min_p * probs.amax(-1))
    return probs.masked_fill(probs < floor[:, None], 0.0)


def apply_masks(logits: torch.Tensor, params: list[SeqSampling]) -> None:
    """In place: every token outside a row's `allowed_mask` bitmap, and each of its
    `banned_ids`, gets -inf.

    Only the rows that carry a mask or bans are touched: their bitmaps are unpacked in one
    numpy call, copied to the device once and applied in one in-place fill, so the cost
    follows the constrained rows, not the batch."""
    rows = [i for i, p in enumerate(params) if p.allowed_mask is not None or p.banned_ids]
    if not rows:
        return
    vocab = logits.shape[-1]
    width = -(-vocab // 8)
    packed = np.full((len(rows), width), 0xFF, dtype=np.uint8)
    for j, i in enumerate(rows):
        allowed = params[i].allowed_mask
        if allowed is not None:
            mask = np.frombuffer(allowed, dtype=np.uint8)[:width]
            packed[j, :len(mask)] = mask
            packed[j, len(mask):] = 0  # a short bitmap allows no more
    banned = np.unpackbits(~packed, axis=1, count=vocab, bitorder="little").view(bool)
    for j, i in enumerate(rows):
        if params[i].banned_ids:
            with_stops = banned[j].copy()
            with_stops[params[i].banned_ids] = True
            if not with_stops.all():  # min_new_tokens yields to a constraint that must stop
                banned[j] = with_stops
    if banned.all(axis=1).any():
        raise ValueError("the masks allow no token")  # the scheduler never sends this
    index = to_device(rows, logits.device)
    logits[index] = logits[index].masked_fill_(to_device(banned, logits.device, torch.bool),
                                               float("-inf"))


def verify_rows(p: SeqSampling) -> list[SeqSampling]:
    """The sampling of each row a speculative sequence verifies (`p.draft`'s k tokens: k + 1
    rows): row i comes after the draft's first i tokens, so it is output step `step + i`,
    its penalties count those tokens, and a constrained request's mask is the grammar's
    state after them (`draft_masks`)."""
    rows = []
    for i in range(len(p.draft) + 1):
        rows.append(msgspec.structs.replace(
            p, step=p.step + i, draft=[], draft_masks=[],
            output_ids=None if p.output_ids is None else p.output_ids + p.draft[:i],
            allowed_mask=p.allowed_mask if i == 0 or p.allowed_mask is None
            else p.draft_masks[i - 1]))
    return rows


def _takes_argmax(p: SeqSampling) -> bool:
    """Whether a row's token is the argmax of the model's logits: greedy, and nothing
    changes them (no penalty, `logit_bias` or mask)."""
    return (is_greedy(p.temperature, p.top_k) and not p.frequency_penalty
            and not p.presence_penalty and p.repetition_penalty == 1.0
            and p.logit_bias is None and p.allowed_mask is None and not p.banned_ids)


class Sampler:
    def __call__(self, logits: torch.Tensor, params: list[SeqSampling]) -> torch.Tensor:
        """`logits`: `[S, vocab]` for S sequences; returns `[S]` token ids (int64) on the
        logits' device, without reading anything back from it. A step whose rows all take
        the argmax copies no parameter to the device."""
        if all([_takes_argmax(p) for p in params]):
            return logits.argmax(dim=-1)
        t = SamplingTensors.of(params, logits.device)
        logits = self._process(logits, params, t)
        tokens = logits.argmax(dim=-1)
        if (d := t.draw) is None:
            return tokens
        drawn = _inverse_cdf(self._probs(logits, d), _uniform(d.seeds, d.steps))
        return torch.where(d.greedy, tokens, drawn)

    def verify(self, logits: torch.Tensor, params: list[SeqSampling]) -> list[list[int]]:
        """Speculative decoding's verification: for each sequence of `params` (each with a
        `draft` of k tokens), its k + 1 consecutive rows of `logits` (row i: the logits
        after the draft's first i tokens). Returns each sequence's new tokens: the draft
        tokens it accepts, then one of its own (at the first rejection, a token drawn in
        the draft's place; after a draft accepted whole, the next token).

        Greedy rows accept a draft token while it is the argmax: the output equals greedy
        decoding without a draft. Sampled rows accept draft token d with probability p(d),
        the target's probability after every filter, and on rejection draw from p with d
        taken out (renormalised): speculative sampling's rule for a draft that proposes d
        with certainty, so each output token is distributed as p, as without a draft.
        Every row's decision and fallback token are found on the device at once and read
        back in one copy."""
        rows = [row for p in params for row in verify_rows(p)]
        t = SamplingTensors.of(rows, logits.device)
        logits = self._process(logits, rows, t)
        draft = to_device([token for p in params for token in (*p.draft, -1)], logits.device)
        tokens = logits.argmax(dim=-1)
        accepted = tokens == draft  # the last row's -1 is never accepted
        if (d := t.draw) is not None:
            probs = self._probs(logits, d).double()
            probs /= probs.sum(-1, keepdim=True)
            held = draft.clamp(min=0)[:, None]
            at_held = probs.gather(-1, held)
            p_draft = torch.where(draft >= 0, at_held[:, 0], 0.0)
            taken = _uniform(d.seeds, d.steps, _ACCEPT_STREAM) < p_draft
            # The draft token taken out (a last row, with none, keeps every token).
            residual = probs.scatter(-1, held, at_held - p_draft[:, None])
            drawn = _inverse_cdf(residual, _uniform(d.seeds, d.steps))
            accepted = torch.where(d.greedy, accepted, taken)
            tokens = torch.where(d.greedy, tokens, drawn)
        keep, own = torch.stack([accepted.long(), tokens]).tolist()
        results, base = [], 0
        for p in params:
            kept: list[int] = []
            for i, token in enumerate(p.draft):
                if not keep[base + i]:
                    break
                kept.append(token)
            kept.append(own[base + len(kept)])
            results.append(kept)
            base += len(p.draft) + 1
        return results

    @staticmethod
    def _process(logits: torch.Tensor, params: list[SeqSampling],
                 t: SamplingTensors) -> torch.Tensor:
        """Penalties, `logit_bias` and masks applied, on a copy when any applies."""
        logits = logits.float()
        penalties = t.counted is not None or t.repeated is not None
        if penalties or t.bias or t.masks:
            logits = logits.clone()  # the caller's logits also give the output logprobs
        if penalties:
            apply_penalties(logits, t)
        if t.bias:
            apply_logit_bias(logits, params)
        if t.masks:
            apply_masks(logits, params)
        return logits

    @staticmethod
    def _probs(logits: torch.Tensor, d: DrawTensors) -> torch.Tensor:
        """Every row's distribution: temperature, then the top-k / top-p / min-p filters
        (unnormalised; greedy rows get their unfiltered softmax, which nothing uses)."""
        return filter_probs(torch.softmax(logits / d.temperature[:, None], dim=-1), d)


_ACCEPT_STREAM = 0x5EC
"""A second seeded stream for speculative acceptance tests, apart from the draws."""


def _shr(z: torch.Tensor, n: int) -> torch.Tensor:
    """The logical right shift of int64 `z` (torch's `>>` keeps the sign)."""
    return (z >> n) & ((1 << (64 - n)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (their multiplication wraps mod 2^64): a
    bijection of 64-bit words whose every output bit depends on every input bit."""
    z = (z ^ _shr(z, 30)) * _int64(_MIX1)
    z = (z ^ _shr(z, 27)) * _int64(_MIX2)
    return z ^ _shr(z, 31)


def _uniform(seeds: torch.Tensor, steps: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """One uniform float64 in [0, 1) per row, a function of (seed, step, stream) alone: a
    counter-based RNG (the hash of the seed, offset by the step, hashed again), so a row
    draws the same number in any batch, on any device. 53 bits, as `random.random`. The
    offsets are splitmix64's increments (counting from 1: `_mix` keeps 0 at 0)."""
    key = _mix(seeds + _int64((stream + 1) * _GOLDEN))
    return _shr(_mix(key + (steps + 1) * _int64(_GOLDEN)), 11).double() * 2.0 ** -53


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of (unnormalised) `probs`, by one batched search of the CDF in
    vocabulary order (float64, so a row's CDF is its own whatever the batch)."""
    cdf = probs.double().cumsum(-1)
    picked = torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:], right=True)
    return picked[:, 0].clamp(max=probs.shape[-1] - 1)
