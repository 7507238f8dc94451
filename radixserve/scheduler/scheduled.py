"""What a step runs, as the scheduler plans it: each sequence's part (`ScheduledSeq`: which of
its tokens it computes, whether it samples, its draft) and the step itself (`ScheduledBatch`).
Plain data; the phases fill it in (scheduler/running_batch.py, admission.py, batch.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.messages import ForwardBatch
from radixserve.scheduler.kv_handle import PrefixLoad
from radixserve.scheduler.request import Req


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
