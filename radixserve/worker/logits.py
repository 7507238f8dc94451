"""A step's logits read into its answers (`SeqOutput`): sampled tokens, forks, verified
drafts and logprobs."""

from __future__ import annotations

import msgspec
import torch

from radixserve.messages import ForwardBatch, SeqLogprobs, SeqOutput, SeqSampling, TopLogprobs
from radixserve.worker.sampler import Sampler


def read_logits(batch: ForwardBatch, logits: torch.Tensor, sampler: Sampler) -> list[SeqOutput]:
    """What a step's logits (its `Worker._prepare` rows) answer: each sequence's
    sampled token (and its forks'), verified drafts, and the logprobs asked for."""
    sample_rows, params, owners, row = [], [], [], 0
    # (sequence, its first verify row, its sampling with the draft)
    drafts: list[tuple[int, int, SeqSampling]] = []
    outputs = [SeqOutput() for _ in batch.q_lens]
    for i, lp in enumerate(batch.logprobs):
        if lp is not None and lp.input_targets:
            n = len(lp.input_targets)
            logprobs = torch.log_softmax(logits[row:row + n], dim=-1)
            targets = torch.tensor(lp.input_targets, device=logits.device)
            outputs[i].input_logprobs = logprobs.gather(1, targets[:, None])[:, 0].tolist()
            if lp.top_n > 0:
                outputs[i].input_top = [_top(r, lp.top_n) for r in logprobs]
            row += n
        s = batch.sample[i]
        if s is not None and s.draft:
            drafts.append((i, row, s))
            row += len(s.draft) + 1
        elif s is not None:
            # A sequence's parallel samples fork here: its row is sampled once more per
            # fork seed, each as that sample's step 0.
            for p in [s, *(msgspec.structs.replace(s, seed=seed, fork_seeds=[])
                           for seed in s.fork_seeds)]:
                sample_rows.append(row)
                params.append(p)
                owners.append(i)
            row += 1
    if drafts:
        _verify(batch, logits, drafts, outputs, sampler)
    if not sample_rows:
        return outputs
    sampled = logits[sample_rows]
    chosen = sampler(sampled, params)
    tokens = chosen.tolist()  # the step's one sync, unless logprobs are asked for
    asked = [batch.logprobs[i] for i in owners]
    chosen_logprobs, tops = _output_logprobs(sampled, chosen, asked)
    for j, i in enumerate(owners):
        out, token, logprob, top = outputs[i], tokens[j], chosen_logprobs[j], tops[j]
        if j == 0 or owners[j - 1] != i:  # the sequence's own sample
            out.next_token, out.output_logprob, out.output_top = token, logprob, top
        else:
            out.fork_tokens.append(token)
            if logprob is not None:
                out.fork_logprobs.append(logprob)
            if top is not None:
                out.fork_top.append(top)
    return outputs


def _output_logprobs(sampled: torch.Tensor, tokens: torch.Tensor,
                     asked: list[SeqLogprobs | None]
                     ) -> tuple[list[float | None], list[TopLogprobs | None]]:
    """Each sampled row's token logprob and top logprobs where its sequence asked for
    them (None elsewhere), found for all those rows at once and read back in two copies
    (the values, the top ids), not a few per row."""
    n = len(asked)
    logprobs: list[float | None] = [None] * n
    tops: list[TopLogprobs | None] = [None] * n
    wanted = [(j, lp) for j, lp in enumerate(asked) if lp is not None and lp.output]
    if not wanted:
        return logprobs, tops
    index = torch.tensor([j for j, _ in wanted], device=sampled.device)
    table = torch.log_softmax(sampled[index], dim=-1)
    values = table.gather(1, tokens[index][:, None])
    width = max(lp.top_n for _, lp in wanted)
    ids: list[list[int]] = []
    if width > 0:
        top = table.topk(width)
        values, ids = torch.cat([values, top.values], dim=1), top.indices.tolist()
    for k, ((j, lp), row) in enumerate(zip(wanted, values.tolist())):
        logprobs[j] = row[0]
        if lp.top_n > 0:
            tops[j] = TopLogprobs(token_ids=ids[k][:lp.top_n], logprobs=row[1:lp.top_n + 1])
    return logprobs, tops


def _verify(batch: ForwardBatch, logits: torch.Tensor,
            drafts: list[tuple[int, int, SeqSampling]], outputs: list[SeqOutput],
            sampler: Sampler) -> None:
    """Speculative sequences: verify each draft on its rows (`Sampler.verify`) and
    report the tokens kept, with their logprobs when asked for."""
    params = [p for _, _, p in drafts]
    rows = [r for _, first, p in drafts for r in range(first, first + len(p.draft) + 1)]
    kept = sampler.verify(logits[rows], params)
    for (i, first, _), tokens in zip(drafts, kept):
        out, lp = outputs[i], batch.logprobs[i]
        out.next_token, out.spec_tokens = tokens[0], tokens[1:]
        if lp is None or not lp.output:
            continue
        logprobs = torch.log_softmax(logits[first:first + len(tokens)], dim=-1)
        chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device)[:, None])
        values = chosen[:, 0].tolist()
        top = [_top(r, lp.top_n) for r in logprobs] if lp.top_n > 0 else []
        out.output_logprob, out.spec_logprobs = values[0], values[1:]
        if top:
            out.output_top, out.spec_top = top[0], top[1:]


def _top(logprobs: torch.Tensor, n: int) -> TopLogprobs:
    values, ids = logprobs.topk(n)
    return TopLogprobs(token_ids=ids.tolist(), logprobs=values.tolist())
