"""A step's logits read into its answers (`SeqOutput`): sampled tokens, forks, verified
drafts and logprobs.

In two halves: `sample_logits` samples the plain rows on the device when the step is
launched (so the next step's placeholders can read them there), and `read_logits` reads
everything back to the host when its result is collected."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import torch

from radixserve.messages import ForwardBatch, SeqLogprobs, SeqOutput, SeqSampling, TopLogprobs
from radixserve.worker.sampler import Sampler
from radixserve.worker.seq_rows import StepSeqs


@dataclass
class StepSamples:
    """A step's logits (its `StepSeqs.logit_rows`), where each sequence's answers are in
    them, and the plain rows' tokens, sampled on the device."""

    logits: torch.Tensor
    rows: list[int] = field(default_factory=list)
    """The plain sampling rows: each sequence's own, then once per fork seed."""
    params: list[SeqSampling] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)
    """Each plain row's sequence (its first row is its own sample, the rest its forks')."""
    inputs: list[tuple[int, int, SeqLogprobs]] = field(default_factory=list)
    """(sequence, its first input-logprob row, what it asked for)."""
    drafts: list[tuple[int, int, SeqSampling]] = field(default_factory=list)
    """(sequence, its first verify row, its sampling with the draft)."""
    sampled: torch.Tensor | None = None
    """The plain rows' logits (None: no plain row)."""
    tokens: torch.Tensor | None = None
    """`[len(rows)]` int64 on the device (None: no plain row)."""
    output_logprobs: bool = False
    """Whether a plain row's sequence asked for its output logprobs."""

    def own_tokens(self, seqs: list[int]) -> torch.Tensor:
        """The tokens sampled for `seqs` (indices of sequences with a plain row, no fork),
        on the device."""
        assert self.tokens is not None
        first = {i: j for j, i in reversed(list(enumerate(self.owners)))}
        index = torch.tensor([first[i] for i in seqs], dtype=torch.long)
        return self.tokens[index.to(self.tokens.device)]


def sample_logits(step: StepSeqs, logits: torch.Tensor, sampler: Sampler) -> StepSamples:
    """Plan where each sequence's answers are in `logits`, and sample the plain rows (not
    the drafts, which `read_logits` verifies) on the device."""
    plan, row = StepSamples(logits), 0
    for i, lp in enumerate(step.batch.logprobs):
        if lp is not None and lp.input_targets:
            plan.inputs.append((i, row, lp))
            row += len(lp.input_targets)
        s = step.sample[i]
        if s is not None and s.draft:
            plan.drafts.append((i, row, s))
            row += len(s.draft) + 1
        elif s is not None:
            # A sequence's parallel samples fork here: its row is sampled once more per
            # fork seed, each as that sample's step 0.
            forks = [msgspec.structs.replace(s, seed=seed, fork_seeds=[])
                     for seed in s.fork_seeds]
            plan.rows += [row] * (1 + len(forks))
            plan.params += [s, *forks]
            plan.owners += [i] * (1 + len(forks))
            plan.output_logprobs |= lp is not None and lp.output
            row += 1
    if plan.rows:
        # Most steps sample every row once, in order: no gather (nor its index's copy).
        whole = plan.rows == list(range(logits.shape[0]))
        plan.sampled = logits if whole else logits[plan.rows]
        plan.tokens = sampler(plan.sampled, plan.params)
    return plan


def read_logits(batch: ForwardBatch, plan: StepSamples, sampler: Sampler) -> list[SeqOutput]:
    """What a step's logits answer (`plan`: `sample_logits`'s): each sequence's sampled
    token (and its forks'), verified drafts, and the logprobs asked for."""
    outputs, logits = [SeqOutput() for _ in batch.q_lens], plan.logits
    for i, row, wanted in plan.inputs:
        n = len(wanted.input_targets)
        logprobs = torch.log_softmax(logits[row:row + n], dim=-1)
        targets = torch.tensor(wanted.input_targets, device=logits.device)
        outputs[i].input_logprobs = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        if wanted.top_n > 0:
            outputs[i].input_top = [_top(r, wanted.top_n) for r in logprobs]
    if plan.drafts:
        _verify(batch, logits, plan.drafts, outputs, sampler)
    if plan.tokens is None or plan.sampled is None:
        return outputs
    owners = plan.owners
    tokens = plan.tokens.tolist()  # the step's one sync, unless logprobs are asked for
    chosen_logprobs: list[float | None] = [None] * len(owners)
    tops: list[TopLogprobs | None] = [None] * len(owners)
    if plan.output_logprobs:
        chosen_logprobs, tops = _output_logprobs(plan.sampled, plan.tokens,
                                                 [batch.logprobs[i] for i in owners])
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
    them (None elsewhere; some row's did), found for all those rows at once and read back
    in two copies (the values, the top ids), not a few per row."""
    n = len(asked)
    logprobs: list[float | None] = [None] * n
    tops: list[TopLogprobs | None] = [None] * n
    wanted = [(j, lp) for j, lp in enumerate(asked) if lp is not None and lp.output]
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
