"""Where a sequence's draft tokens come from, and how many it may send (speculative
decoding without a draft model).

Each step, a decoding sequence with speculation on proposes up to
`speculative_num_draft_tokens` tokens to follow its last one (`Drafter.propose`); the
worker runs them through the model in the same forward and keeps the run the model agrees
with (`Sampler.verify`), and the scheduler takes the kept tokens in
(`Scheduler._fold_run`) and gives back the KV of the rest. A step whose draft is rejected
outright still yields its one token, so a wrong draft costs only the extra rows' compute.

Sources (the request's `speculative` mode, else the server's):
- `lookup`: the sequence's own context (prompt lookup, `lookup.ContextLookup`): the text
  it is writing often copies its prompt (quoted tool results, extracted spans) or itself;
- `tree`: also the radix tree's suffix index (`suffix_index.SuffixIndex`) in the request's
  namespace: what earlier prompts and outputs continued this tail with (an answer given
  before, a tool call's usual shape). The longer of the two proposals goes.

How many: each sequence keeps a running acceptance rate (starting from what its mode's
recent sequences achieved) and drafts that share of the most it may, so a sequence whose
drafts keep failing drafts nothing; it tries one token again every `PROBE_EVERY` steps, in
case its text turned repetitive (`seq_drafts.SeqDrafts`). And no further than its draft's
tokens are likelier to be kept than a row costs: the scheduler times its steps
(`step_cost.StepCost`), so a large batch, whose rows cost as much as the tokens they might
save, drafts only what is nearly sure.
"""

from __future__ import annotations

from typing import Any, Protocol

from radixserve.messages import SamplingParams
from radixserve.speculative.seq_drafts import SeqDrafts
from radixserve.speculative.suffix_index import SuffixIndex

FIRST_ACCEPTANCE = 0.6
"""The acceptance assumed before any draft is verified: enough for drafts at small batches
(where a row is nearly free), too little for a compute-bound one to gamble on."""
PRIOR_WEIGHT = 0.02
"""Weight of one verified draft in its mode's acceptance over all sequences."""


class Seq(Protocol):
    """What the drafter reads and keeps of a decoding sequence (scheduler/request.py's
    Req): the scheduler's package sits above this one, so it is named here, not imported."""

    drafts: SeqDrafts | None
    sampling: SamplingParams
    group: Any  # its SeqGroup: `search` (a beam search, or None) and `unforked`
    output_ids: list[int]
    namespace: str | None

    @property
    def seq_len(self) -> int: ...

    def tokens(self, start: int, end: int) -> list[int]: ...


class Drafter:
    """Drafts for the scheduler's decoding sequences (no torch, no sockets)."""

    def __init__(self, mode: str, max_draft: int, index: SuffixIndex | None) -> None:
        """`mode`: the server's default (`off`, `lookup`, `tree`); `index`: the radix
        tree's suffix index, which `tree` reads (None: the prefix cache is off, so `tree`
        drafts as `lookup`)."""
        self.mode, self.max_draft, self.index = mode, max_draft, index
        self.acceptance = {"lookup": FIRST_ACCEPTANCE, "tree": FIRST_ACCEPTANCE}
        """Each mode's recent acceptance over every sequence: where a new sequence starts,
        so that where drafts rarely hold, new sequences in a compute-bound batch do not
        each pay for a first full draft to learn it."""

    def _drafts(self, req: Seq) -> SeqDrafts | None:
        """`req`'s speculation state (made on first use), or None where it never
        speculates: off for it, or a beam search."""
        if req.drafts is not None:
            return req.drafts
        mode = req.sampling.speculative or self.mode
        if mode == "off" or req.group.search is not None:
            return None
        req.drafts = SeqDrafts(mode, acceptance=self.acceptance[mode])
        return req.drafts

    def propose(self, req: Seq, most: int, break_even: float) -> list[int]:
        """Up to `most` tokens to follow `req`'s last token (none where it does not
        speculate now); `break_even`: the chance of acceptance a draft row must beat
        (`SeqDrafts.limit`)."""
        d = self._drafts(req)
        if d is None or req.group.unforked or len(req.output_ids) < req.sampling.min_new_tokens:
            return []
        n = d.limit(min(most, self.max_draft), break_even)
        draft = self._source(d, req, n) if n > 0 else []
        d.idle = 0 if draft else d.idle + 1
        return draft

    def _source(self, d: SeqDrafts, req: Seq, n: int) -> list[int]:
        """Up to `n` tokens from `req`'s sources (see the module docstring)."""
        end = req.seq_len
        d.lookup.extend(req.tokens(len(d.lookup.tokens), end))
        draft = d.lookup.propose(n)
        if d.mode == "tree" and self.index is not None:
            tail = req.tokens(max(0, end - self.index.max_context), end)
            shared = self.index.propose(req.namespace, tail, n)
            if len(shared) > len(draft):
                draft = shared
        return draft

    def record(self, req: Seq, drafted: int, accepted: int) -> None:
        """A step verified `drafted` tokens of `req`'s draft and accepted `accepted`."""
        d = req.drafts
        assert d is not None
        d.record(drafted, accepted)
        self.acceptance[d.mode] += PRIOR_WEIGHT * (accepted / drafted - self.acceptance[d.mode])
