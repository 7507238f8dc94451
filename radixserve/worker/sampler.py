"""Turn each sequence's logits into its next token.

Penalties apply first, then `logit_bias`, then the grammar masks (tokens a constrained
request may not take get -inf, so greedy and sampled rows alike pick an allowed token), then
temperature, then the top-k / top-p / min-p filters, all on a copy: the caller's logits
give the output logprobs, which stay the model's. Greedy rows take the argmax. Each
sampling row draws from its own generator seeded with (request seed, output index), so a
seeded request gets the same tokens whatever batch it runs in, and after a retraction it
resumes exactly where it stopped.

The masks also keep EOS and the stop tokens out until a request's `min_new_tokens` are out.
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from radixserve.messages import SeqSampling

_SEED_MIX = 0x9E3779B97F4A7C15


def apply_penalties(logits: torch.Tensor, params: list[SeqSampling]) -> None:
    """In place: OpenAI frequency/presence penalties over the outputs, and the Hugging Face
    repetition penalty over prompt and outputs."""
    vocab = logits.shape[-1]
    for row, p in enumerate(params):
        outputs = torch.tensor(p.output_ids or [], dtype=torch.long, device=logits.device)
        if (p.frequency_penalty or p.presence_penalty) and len(outputs):
            counts = torch.bincount(outputs, minlength=vocab).to(logits.dtype)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor((p.prompt_ids or []) + (p.output_ids or []), dtype=torch.long,
                                device=logits.device).unique()
            if len(seen):
                picked = logits[row, seen]
                logits[row, seen] = torch.where(picked > 0, picked / p.repetition_penalty,
                                                picked * p.repetition_penalty)


def apply_logit_bias(logits: torch.Tensor, params: list[SeqSampling]) -> None:
    """In place: each row's `logit_bias` values added to its tokens' logits, in one
    scatter; the packed bytes become tensors without a Python list per entry."""
    rows = [(row, p.logit_bias) for row, p in enumerate(params) if p.logit_bias is not None]
    ids = np.concatenate([np.frombuffer(b.ids, dtype=np.int32) for _, b in rows])
    values = np.concatenate([np.frombuffer(b.values, dtype=np.float32) for _, b in rows])
    counts = torch.tensor([len(b.ids) // 4 for _, b in rows])
    row_ids = torch.tensor([row for row, _ in rows]).repeat_interleave(counts)
    device = logits.device
    logits.index_put_((row_ids.to(device), torch.from_numpy(ids).long().to(device)),
                      torch.from_numpy(values).to(device, logits.dtype), accumulate=True)


def filter_probs(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor) -> torch.Tensor:
    """Zero out what top-k, top-p and min-p exclude, per row (unnormalised result).

    A full vocabulary sort is only paid when some row asks for top-p."""
    vocab = probs.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)[:, None]
    if bool((top_p < 1).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=probs.device)[None, :]
        drop = ranks >= k
        # Keep a token while the mass strictly before it is below top_p (the first stays).
        drop |= (sorted_probs.cumsum(-1) - sorted_probs) >= top_p[:, None]
        drop |= sorted_probs < min_p[:, None] * sorted_probs[:, :1]
        return torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(drop, 0.0))
    if bool((k < vocab).any()):
        kth = probs.topk(int(k.max()), dim=-1).values.gather(-1, k - 1)
        probs = probs.masked_fill(probs < kth, 0.0)
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), 0.0)
    return probs


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
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill_(torch.from_numpy(banned).to(logits.device),
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


class Sampler:
    def __call__(self, logits: torch.Tensor, params: list[SeqSampling]) -> torch.Tensor:
        """`logits`: `[S, vocab]` for S sequences; returns `[S]` token ids (int64)."""
        logits = self._process(logits, params)
        tokens = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return tokens
        chosen = [params[i] for i in rows]
        probs = self._probs(logits[torch.tensor(rows, device=logits.device)], chosen)
        uniform = [_uniform(p.seed, p.step) for p in chosen]
        tokens[torch.tensor(rows, device=logits.device)] = _inverse_cdf(probs, uniform)
        return tokens

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
        with certainty, so each output token is distributed as p, as without a draft."""
        rows = [row for p in params for row in verify_rows(p)]
        logits = self._process(logits, rows)
        argmax = logits.argmax(dim=-1).tolist()
        sampled = [i for i, r in enumerate(rows) if not r.greedy]
        probs: dict[int, torch.Tensor] = {}
        if sampled:
            filtered = self._probs(logits[torch.tensor(sampled, device=logits.device)],
                                   [rows[i] for i in sampled]).double().cpu()
            probs = {row: filtered[j] / filtered[j].sum() for j, row in enumerate(sampled)}
        results, base = [], 0
        for p in params:
            tokens = []
            for i, draft in enumerate([*p.draft, None]):
                row, r = base + i, rows[base + i]
                if row not in probs:  # greedy
                    tokens.append(argmax[row])
                    if argmax[row] != draft:
                        break
                    continue
                dist = probs[row]
                if draft is not None:
                    if _uniform(r.seed, r.step, _ACCEPT_STREAM) < float(dist[draft]):
                        tokens.append(draft)
                        continue
                    dist = dist.clone()
                    dist[draft] = 0.0
                tokens.append(int(_inverse_cdf(dist[None], [_uniform(r.seed, r.step)])[0]))
                break
            results.append(tokens)
            base += len(p.draft) + 1
        return results

    @staticmethod
    def _process(logits: torch.Tensor, params: list[SeqSampling]) -> torch.Tensor:
        """Penalties, `logit_bias` and masks applied, on a copy when any applies."""
        logits = logits.float()
        penalties = any(p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0
                        for p in params)
        bias = any(p.logit_bias is not None for p in params)
        masks = any(p.allowed_mask is not None or p.banned_ids for p in params)
        if penalties or bias or masks:
            logits = logits.clone()  # the caller's logits also give the output logprobs
        if penalties:
            apply_penalties(logits, params)
        if bias:
            apply_logit_bias(logits, params)
        if masks:
            apply_masks(logits, params)
        return logits

    @staticmethod
    def _probs(logits: torch.Tensor, params: list[SeqSampling]) -> torch.Tensor:
        """The sampled rows' distributions: temperature, then the top-k / top-p / min-p
        filters (unnormalised)."""
        device = logits.device
        temps = torch.tensor([p.temperature for p in params], device=device)
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        return filter_probs(
            probs,
            torch.tensor([p.top_k for p in params], device=device),
            torch.tensor([p.top_p for p in params], device=device),
            torch.tensor([p.min_p for p in params], device=device),
        )


_ACCEPT_STREAM = 0x5EC
"""A second seeded stream for speculative acceptance tests, apart from the draws."""


def _uniform(seed: int, step: int, stream: int = 0) -> float:
    """The seeded uniform of (request seed, output index[, stream])."""
    generator = torch.Generator()
    generator.manual_seed((seed * _SEED_MIX + step + stream * _SEED_MIX ** 2) % (1 << 63))
    return float(torch.rand(1, generator=generator, dtype=torch.float64)[0])


def _inverse_cdf(probs: torch.Tensor, uniform: list[float]) -> torch.Tensor:
    """One token per row of (unnormalised) `probs`, by one batched search of the CDF."""
    cdf = probs.double().cumsum(-1)
    u = torch.tensor(uniform, dtype=torch.float64, device=probs.device)
    picked = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True)
    return picked[:, 0].clamp(max=probs.shape[-1] - 1)
