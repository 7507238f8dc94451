"""The scheduler's side of speculative decoding (the drafts themselves come from
radixserve/speculative/): which decoding sequences carry a draft this step, with KV room
for it, and what a verified step keeps."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.config import EngineConfig
from radixserve.messages import ForwardResult, SeqOutput, TopLogprobs
from radixserve.scheduler.batch import ScheduledBatch, ScheduledSeq
from radixserve.scheduler.features import StepFeature
from radixserve.scheduler.kv import KVManager
from radixserve.scheduler.mappings import MappingAccount
from radixserve.scheduler.request import Req
from radixserve.speculative.drafter import Drafter
from radixserve.speculative.step_cost import StepCost
from radixserve.speculative.suffix_index import SuffixIndex


@dataclass(slots=True)
class KeptRun:
    """What a verified step keeps of one sequence: the accepted draft tokens and the one
    after them, with their logprobs and top logprobs (None where not asked for)."""

    tokens: list[int]
    logprobs: list[float | None]
    tops: list[TopLogprobs | None]
    computed: int
    """The sequence's tokens whose KV is now valid (its last token's and the accepted
    drafts'); the rest of what the step wrote was dropped."""


class Speculation(StepFeature):
    """Drafts for the decoding sequences, room for their KV, and the verified runs. On when
    the server speculates, or from the first request that asks to (`speculative`); its hooks:
    `draft` and `folded` (the step's cost observed)."""

    def __init__(self, config: EngineConfig, index: SuffixIndex | None, kv: KVManager,
                 maps: MappingAccount | None) -> None:
        """`index`: the radix tree's suffix index (None: `tree` drafts as `lookup`)."""
        self.drafter = Drafter(config.speculative, config.speculative_num_draft_tokens, index)
        self.kv, self.maps = kv, maps
        self.cost = StepCost()
        self.break_even = 0.0
        """The last step's (`StepCost.break_even`), for the stats."""
        self.steps = self.drafted = self.accepted = 0

    def folded(self, batch: ScheduledBatch, result: ForwardResult | None) -> set[int]:
        if result is not None:
            self.observe(batch.seqs, result.forward_seconds)
        return set()

    def observe(self, seqs: list[ScheduledSeq], seconds: float) -> None:
        """A step of `seqs` ran in `seconds`. Prompt chunks count with decodes and drafts:
        their rows cost much as a draft row does (more over a long prefix, which only
        makes drafts more careful), and they let the fit see a step's cost at several
        sizes from the first requests on. A step of no rows (disk transfers alone) is not
        a forward's cost. Free while nothing speculates: the fit learns from the steps that
        carry a sequence that may draft, which are the steps whose drafts it prices."""
        if not self._speculates(seqs):
            return
        rows = sum(seq.n + len(seq.draft) for seq in seqs)
        if rows:
            self.cost.observe(rows, seconds)

    def draft(self, decodes: list[ScheduledSeq], budget: int, running: list[Req]) -> int:
        """Give the decoding sequences drafts to verify in this step, of at most `budget`
        tokens in all; returns how many they took. Free where no sequence speculates (the
        server's mode and each request's are off): the drafter is not asked."""
        if not self._speculates(decodes):
            return 0
        break_even = self.cost.break_even(len(decodes))
        self.break_even = break_even
        taken = 0
        for seq in decodes:
            taken += self._draft(seq, budget - taken, running, break_even)
        return taken

    def _speculates(self, seqs: list[ScheduledSeq]) -> bool:
        """Whether any of `seqs` speculates (its own mode, or else the server's, not off)."""
        mode = self.drafter.mode
        return any((seq.req.sampling.speculative or mode) != "off" for seq in seqs)

    def _draft(self, seq: ScheduledSeq, budget: int, running: list[Req],
               break_even: float) -> int:
        """Give `seq` a draft of at most `budget` tokens, as far as its KV fits in blocks
        free now or reclaimable from the cache (a draft never retracts anything); returns
        the draft's length."""
        req, kv = seq.req, self.kv
        draft = self.drafter.propose(req, min(budget, req.remaining_new_tokens - 1), break_even)
        if req.grammar is not None and draft:
            draft, seq.draft_masks = req.grammar.check_draft(draft)
        maps = self.maps  # None: a layout without mappings, where every draft fits
        while draft and maps and not maps.grows(running, req,
                                                kv.blocks_for([req.kv], 1 + len(draft))):
            draft = draft[:-1]
        fits = kv.grow(req.kv, 1 + len(draft)) - 1 if draft else 0
        seq.draft = draft[:fits]
        del seq.draft_masks[fits:]
        return len(seq.draft)

    def kept(self, req: Req, out: SeqOutput, drafted: int) -> KeptRun:
        """The worker verified `drafted` draft tokens of `req` (`out`): count them, give back
        the KV of the rejected ones, and return what it keeps."""
        tokens = [out.next_token, *out.spec_tokens]
        accepted = len(tokens) - 1
        self.drafter.record(req, drafted, accepted)
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        computed = req.kv.kv_len + accepted
        self.kv.truncate(req.kv, computed)
        logprobs: list[float | None] = ([out.output_logprob, *out.spec_logprobs]
                                        if out.output_logprob is not None else [None] * len(tokens))
        tops: list[TopLogprobs | None] = ([out.output_top, *out.spec_top]
                                          if out.output_top is not None else [None] * len(tokens))
        return KeptRun(tokens, logprobs, tops, computed)

    def stats(self) -> dict[str, int | float]:
        return {"spec_steps": self.steps, "spec_draft_tokens": self.drafted,
                "spec_accepted_tokens": self.accepted,
                "spec_acceptance_rate": self.accepted / max(self.drafted, 1),
                "spec_break_even": self.break_even}
