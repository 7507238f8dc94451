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
    """In place: each row's `bias_values` added to its `bias_ids` logits, in one scatter."""
    rows = [row for row, p in enumerate(params) for _ in p.bias_ids]
    ids = [t for p in params for t in p.bias_ids]
    values = [v for p in params for v in p.bias_values]
    device = logits.device
    logits.index_put_((torch.tensor(rows, device=device), torch.tensor(ids, device=device)),
                      torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)


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
        if params[i].allowed_mask is not None:
            mask = np.frombuffer(params[i].allowed_mask, dtype=np.uint8)[:width]
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


class Sampler:
    def __call__(self, logits: torch.Tensor, params: list[SeqSampling]) -> torch.Tensor:
        """`logits`: `[S, vocab]` for S sequences; returns `[S]` token ids (int64)."""
        logits = logits.float()
        penalties = any(p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0
                        for p in params)
        bias = any(p.bias_ids for p in params)
        masks = any(p.allowed_mask is not None or p.banned_ids for p in params)
        if penalties or bias or masks:
            logits = logits.clone()  # the caller's logits also give the output logprobs
        if penalties:
            apply_penalties(logits, params)
        if bias:
            apply_logit_bias(logits, params)
        if masks:
            apply_masks(logits, params)
        tokens = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if p.temperature >= 1e-6 and p.top_k != 1]
        if not rows:
            return tokens
        device = logits.device
        sel = torch.tensor(rows, device=device)
        chosen = [params[i] for i in rows]
        temps = torch.tensor([p.temperature for p in chosen], device=device)
        probs = torch.softmax(logits[sel] / temps[:, None], dim=-1)
        probs = filter_probs(
            probs,
            torch.tensor([p.top_k for p in chosen], device=device),
            torch.tensor([p.top_p for p in chosen], device=device),
            torch.tensor([p.min_p for p in chosen], device=device),
        )
        # Inverse-CDF sampling: one seeded uniform per row, then one batched search.
        generator = torch.Generator()
        uniform = torch.empty(len(chosen), dtype=torch.float64)
        for j, p in enumerate(chosen):
            generator.manual_seed((p.seed * _SEED_MIX + p.step) % (1 << 63))
            uniform[j] = torch.rand(1, generator=generator, dtype=torch.float64)[0]
        cdf = probs.double().cumsum(-1)
        picked = torch.searchsorted(cdf, uniform.to(device)[:, None] * cdf[:, -1:],
                                    right=True)
        tokens[sel] = picked[:, 0].clamp(max=probs.shape[-1] - 1)
        return tokens
