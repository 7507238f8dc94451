"""The step, the third phase: what it runs, as the scheduler plans it (each sequence's part,
`ScheduledSeq`: which of its tokens it computes, whether it samples, its draft, made by
`plan_seq` as the running batch grows and admission adds; and the step itself,
`ScheduledBatch`), and the worker's `ForwardBatch` built from it, which carries only what
changed in the batch the worker keeps (scheduler/worker_rows.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.messages import ForwardBatch, SeqLogprobs, StepSampling
from radixserve.scheduler.kv_handle import PrefixLoad
from radixserve.scheduler.request import Req
from radixserve.scheduler.worker_rows import WorkerRows


@dataclass
class ScheduledSeq:
    req: Req
    start: int
    """Tokens of the sequence already in the KV cache; this step computes `start:start+n`."""
    n: int
    sample: bool
    """True when this step reaches the end of the sequence, so its last row is sampled."""
    logprob_rows: range
    """Positions whose logits score the next prompt token (input logprobs)."""
    draft: list[int] = field(default_factory=list)
    """Speculative decoding: tokens proposed to follow the sequence, computed after its
    `n` and verified in this step (their KV is written at the positions after them)."""
    draft_masks: list[bytes] = field(default_factory=list)
    """A constrained sequence's mask after each draft token."""


@dataclass
class ScheduledBatch:
    """One step: the sequences it runs, the worker's batch, and the prefixes it reads
    back from the disk tier."""

    seqs: list[ScheduledSeq]
    forward: ForwardBatch
    loads: list[PrefixLoad] = field(default_factory=list)


def plan_seq(req: Req, n: int) -> ScheduledSeq:
    start = req.kv.kv_len
    end = start + n
    sample = end == req.seq_len + req.behind and req.remaining_new_tokens > 0
    rows = range(0)
    if req.wants_input_logprobs:
        # Position p's logits score token p + 1; prompt logprobs start at logprob_start_len.
        lo = max(req.logprob_start_len - 1, 0, start)
        rows = range(lo, max(lo, min(end, len(req.input_ids) - 1)))
    return ScheduledSeq(req, start, n, sample, rows)


def _step_sampling(req: Req, s: ScheduledSeq, i: int,
                   eos_ids: frozenset[int]) -> StepSampling | None:
    """What `req` (the step's `i`-th sequence, sampled) samples with this step besides its
    row's parameters (`worker_rows.py` Sampling), or None: nothing."""
    sp, step = req.sampling, StepSampling(i)
    if req.sampled < sp.min_new_tokens:  # EOS even with ignore_eos, as in SGLang
        step.banned_ids = sorted(eos_ids.union(sp.stop_token_ids or ()))
    if req.group.unforked and not req.output_ids:
        step.fork_seeds = [fork.seed for fork in req.group.unforked]
    if req.grammar is not None:
        step.allowed_mask = req.grammar.mask()  # filled when the state last changed
    step.draft, step.draft_masks = s.draft, s.draft_masks
    if step.banned_ids or step.fork_seeds or step.allowed_mask is not None or step.draft:
        return step
    return None


def build_forward_batch(seqs: list[ScheduledSeq], rows: WorkerRows, running: list[Req],
                        block_copies: list[tuple[int, int]],
                        eos_ids: frozenset[int]) -> ForwardBatch:
    """The step for the worker: its sequences by their ids in `rows`, with what changed in
    the batch the worker keeps (rows no longer `running` ended, and each piece's change:
    `WorkerRows.account`). Each sequence's new KV counts as computed from now on
    (`kv_len`): the worker runs the steps in the order they are sent, so every later step
    reads it."""
    batch = ForwardBatch(seqs=[], input_ids=[], q_lens=[], kv_lens=[],
                         block_copies=block_copies, logprobs=[])
    rows.start_step(running, batch)
    for i, s in enumerate(seqs):
        req, end = s.req, s.start + s.n + len(s.draft)
        # A token still `behind` is not known here: its piece sends a placeholder for it.
        batch.input_ids.extend(req.tokens(s.start, s.start + s.n - req.behind))
        batch.input_ids.extend(s.draft)
        batch.q_lens.append(end - s.start)
        batch.kv_lens.append(end)
        req.kv.kv_len = s.start + s.n  # (a draft's KV counts once it is kept)
        if not s.sample:
            batch.unsampled.append(i)
        elif (step := _step_sampling(req, s, i, eos_ids)) is not None:
            batch.sample_steps.append(step)
        rows.account(req, i, batch, s.sample)  # its row's id, what the worker lacks of it
        search = req.group.search  # a beam reports its best continuations
        wants_output = s.sample and (req.return_logprob or search is not None)
        if s.logprob_rows or wants_output:
            batch.logprobs.append(SeqLogprobs(
                input_targets=req.tokens(s.logprob_rows.start + 1, s.logprob_rows.stop + 1)
                if s.logprob_rows else [],
                input_start=s.logprob_rows.start - s.start if s.logprob_rows else 0,
                output=wants_output,
                top_n=req.top_logprobs_num if search is None else search.candidates_per_beam))
        else:
            batch.logprobs.append(None)
    return batch
