"""A step's logits read into its answers (`SeqOutput`): sampled tokens, forks, verified
drafts and logprobs.

In two halves: `sample_logits` samples the plain rows on the device when the step is
launched (so the next step's placeholders can read them there), computes the logprobs
asked for and starts their copy back with the tokens' (`Readback`: one wait per
step); `read_logits` waits for that copy when the step's result is collected."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from radixserve.messages import ForwardBatch, SeqLogprobs, SeqOutput, SeqSampling, TopLogprobs
from radixserve.worker.sampler import Sampler
from radixserve.worker.seq_rows import StepSeqs
from radixserve.worker.staging import to_device


class Readback:
    """A step's one wait for the device: what its answer needs, read back together.

    On a GPU every read of a device value makes the host wait for the device's queue up to
    it. With overlap the next step is queued behind this one before this one's answer is
    read, so a plain `.tolist()` in `collect` would wait for the next step as well. A
    `Readback` is started when the step is launched, right after its last kernel: each
    tensor copied into pinned host memory (`non_blocking`), an event recorded behind the
    copies; `wait`, in `collect`, waits for that event alone and makes lists of the copies.
    On the CPU the values are there already. A plain decode step makes exactly one (its
    tokens and any logprobs), which tests/worker/test_host_syncs.py counts."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.event: torch.cuda.Event | None = None
        if tensors and tensors[0].device.type == "cuda":
            self.host = [t.to("cpu", non_blocking=True) for t in tensors]  # into pinned memory
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tensors

    def wait(self) -> list[Any]:
        """Each tensor's values (`tolist`), in order: the step's one wait."""
        if self.event is not None:
            self.event.synchronize()
        return [t.tolist() for t in self.host]


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
    logprob_rows: list[tuple[int, SeqLogprobs]] = field(default_factory=list)
    """The plain rows whose sequence asked for output logprobs: (row index, what it asked)."""
    top_width: int = 0
    """The most top logprobs one of them asked for."""
    readback: Readback | None = None
    """What `read_logits` reads back, started at launch (`_readback`)."""

    def own_tokens(self, seqs: list[int]) -> torch.Tensor:
        """The tokens sampled for `seqs` (indices of sequences with a plain row, no fork),
        on the device."""
        assert self.tokens is not None
        first = {i: j for j, i in reversed(list(enumerate(self.owners)))}
        return self.tokens[to_device([first[i] for i in seqs], self.tokens.device)]


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
            row += 1
    if plan.rows:
        # Most steps sample every row once, in order: no gather (nor its index's copy).
        whole = plan.rows == list(range(logits.shape[0]))
        plan.sampled = logits if whole else logits[to_device(plan.rows, logits.device)]
        plan.tokens = sampler(plan.sampled, plan.params)
        asked = [step.batch.logprobs[i] for i in plan.owners]
        plan.logprob_rows = [(j, lp) for j, lp in enumerate(asked) if lp is not None and lp.output]
        plan.top_width = max([lp.top_n for _, lp in plan.logprob_rows], default=0)
    plan.readback = _readback(plan)
    return plan


def read_logits(batch: ForwardBatch, plan: StepSamples, sampler: Sampler) -> list[SeqOutput]:
    """What a step's logits answer (`plan`: `sample_logits`'s): each sequence's sampled
    token (and its forks'), verified drafts, and the logprobs asked for."""
    outputs = [SeqOutput() for _ in batch.q_lens]
    values = iter(plan.readback.wait() if plan.readback is not None else [])
    for i, _, wanted in plan.inputs:
        outputs[i].input_logprobs = next(values)
        if wanted.top_n > 0:
            outputs[i].input_top = [TopLogprobs(token_ids=ids, logprobs=lps)
                                    for lps, ids in zip(next(values), next(values))]
    if plan.drafts:
        _verify(batch, plan.logits, plan.drafts, outputs, sampler)
    if plan.tokens is None:
        return outputs
    owners, tokens = plan.owners, next(values)
    chosen_logprobs: list[float | None] = [None] * len(owners)
    tops: list[TopLogprobs | None] = [None] * len(owners)
    if plan.logprob_rows:
        rows = next(values)
        top_ids = next(values) if plan.top_width > 0 else []
        for k, ((j, lp), row) in enumerate(zip(plan.logprob_rows, rows)):
            chosen_logprobs[j] = row[0]
            if lp.top_n > 0:
                tops[j] = TopLogprobs(token_ids=top_ids[k][:lp.top_n],
                                      logprobs=row[1:lp.top_n + 1])
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


def _readback(plan: StepSamples) -> Readback | None:
    """Everything `read_logits` reads of the plain and input rows, computed on the device
    now (before the next step is queued, whose graph replay may write over these logits)
    and copied back together: per input-logprob sequence its chosen values (then its top
    values and ids), then the tokens, then the output logprob rows (chosen, then the top
    values) and their top ids."""
    tensors: list[torch.Tensor] = []
    for _, row, wanted in plan.inputs:
        n = len(wanted.input_targets)
        logprobs = torch.log_softmax(plan.logits[row:row + n], dim=-1)
        targets = to_device(wanted.input_targets, logprobs.device)
        tensors.append(logprobs.gather(1, targets[:, None])[:, 0])
        if wanted.top_n > 0:
            top = logprobs.topk(wanted.top_n)
            tensors += [top.values, top.indices]
    if plan.tokens is None or plan.sampled is None:
        return Readback(tensors) if tensors else None
    tensors.append(plan.tokens)
    if plan.logprob_rows:
        index = to_device([j for j, _ in plan.logprob_rows], plan.sampled.device)
        table = torch.log_softmax(plan.sampled[index], dim=-1)
        rows = table.gather(1, plan.tokens[index][:, None])
        if plan.top_width > 0:
            top = table.topk(plan.top_width)
            rows = torch.cat([rows, top.values], dim=1)
            tensors += [rows, top.indices]
        else:
            tensors.append(rows)
    return Readback(tensors)


def _verify(batch: ForwardBatch, logits: torch.Tensor,
            drafts: list[tuple[int, int, SeqSampling]], outputs: list[SeqOutput],
            sampler: Sampler) -> None:
    """Speculative sequences: verify each draft on its rows (`Sampler.verify`) and
    report the tokens kept, with their logprobs when asked for."""
    params = [p for _, _, p in drafts]
    rows = [r for _, first, p in drafts for r in range(first, first + len(p.draft) + 1)]
    kept = sampler.verify(logits[to_device(rows, logits.device)], params)
    for (i, first, _), tokens in zip(drafts, kept):
        out, lp = outputs[i], batch.logprobs[i]
        out.next_token, out.spec_tokens = tokens[0], tokens[1:]
        if lp is None or not lp.output:
            continue
        logprobs = torch.log_softmax(logits[first:first + len(tokens)], dim=-1)
        chosen = logprobs.gather(1, to_device(tokens, logits.device)[:, None])
        values = chosen[:, 0].tolist()
        top = [_top(r, lp.top_n) for r in logprobs] if lp.top_n > 0 else []
        out.output_logprob, out.spec_logprobs = values[0], values[1:]
        if top:
            out.output_top, out.spec_top = top[0], top[1:]


def _top(logprobs: torch.Tensor, n: int) -> TopLogprobs:
    values, ids = logprobs.topk(n)
    return TopLogprobs(token_ids=ids.tolist(), logprobs=values.tolist())
