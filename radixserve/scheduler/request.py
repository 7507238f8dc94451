"""A request as the scheduler tracks it: each output a sequence (`Req`: its tokens, its KV
handle, what it returns), and the request itself the group of them (`SeqGroup`: which
sequences it has, the samples still to fork, a beam search's state).

Parallel samples (`n` > 1) and beams are the same thing to the scheduler: sequences of one
request that share KV by forking. Samples fork once, from the first sequence (the leader),
after it has computed the prompt; beams fork at every step, as the search decides. The
group only decides; the scheduler gives each new sequence its share of the KV and its place
in the queues (`Folding._place_fork`, scheduler/finish.py).
"""

from __future__ import annotations

import random
from collections.abc import Collection
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from radixserve.messages import (LogitBias, RequestUpdate, SamplingParams, SeqOutput,
                                 TokenizedRequest, TopLogprobs)
from radixserve.scheduler.beam import BeamCandidates, BeamSearch
from radixserve.scheduler.grammar import Grammar, GrammarState
from radixserve.scheduler.kv_handle import KVHandle
from radixserve.speculative.seq_drafts import SeqDrafts
from radixserve.stop_strings import SearchBudget, Stops
from radixserve.tenants import DEFAULT_TENANT


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    """One sequence: output `index` of the request `rid` (a sample, or a beam). Its tokens
    are `input_ids + output_ids`; the KV of the first `kv.kv_len` of them is held by its
    handle `kv` (scheduler/kv_handle.py)."""

    rid: str
    index: int
    input_ids: list[int]
    sampling: SamplingParams
    seed: int
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    namespace: str | None = None
    """The radix cache namespace of its request (tenant, cache_salt and LoRA adapter): every
    lookup and insert of its prefixes, and the kept partial blocks, are in it alone."""
    lora: str | None = None
    """The LoRA adapter it runs under, by name (None: the base model)."""
    stops: Stops | None = None
    """The stop strings and patterns of `sampling`, compiled; None when it has none (so a
    request without them costs nothing of stop_strings.py)."""
    stop_from: int = 0
    """The output token where a stop pattern's match may still begin (scheduler/finish.py):
    each step searches the text from there, not the whole output."""
    stop_budget: SearchBudget | None = None
    """Its time left for partial-match searches (`Stops.resume_at`); once spent,
    `stop_from` stays where it is. Made with `stops`."""

    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    behind: int = 0
    """Overlap scheduling (scheduler/overlap.py): tokens sampled for it by steps launched
    and not folded yet, which `output_ids` lacks. Planning counts them (`to_compute`,
    `sampled`): its next step may run before they are known."""
    kv: KVHandle = field(init=False)
    """Its KV: blocks, lengths, locked tree node, disk load (changed by scheduler/kv.py)."""
    admitted: bool = False
    wants_input_logprobs: bool = field(init=False)
    """Prompt logprobs are still owed: asked for (`logprob_start_len` >= 0) and not all
    computed yet (they are computed once, never again after a retraction)."""
    finish_reason: dict[str, Any] | None = None
    grammar: GrammarState | None = None
    """The state of a constrained request (see scheduler/grammar.py), else None."""
    drafts: SeqDrafts | None = None
    """Its speculative decoding state (radixserve/speculative/seq_drafts.py), made when it
    first decodes with speculation on; None otherwise."""
    group: SeqGroup = field(init=False, repr=False)
    """Its request's outputs, set when the group is made (`SeqGroup.of`)."""

    input_logprobs: list[float | None] = field(default_factory=list)
    input_top: list[TopLogprobs | None] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[TopLogprobs] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.kv = KVHandle(self.namespace)
        self.wants_input_logprobs = self.return_logprob and self.logprob_start_len >= 0
        if self.sampling.stop is not None or self.sampling.stop_regex is not None:
            self.stops = Stops.of(self.sampling)  # patterns are compiled once per process
            self.stop_budget = SearchBudget(self.sampling.n)

    @property
    def name(self) -> str:
        """For messages and logs only; nothing parses it."""
        return f"{self.rid!r}[{self.index}]"

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    def token(self, pos: int) -> int:
        n = len(self.input_ids)
        return self.input_ids[pos] if pos < n else self.output_ids[pos - n]

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.input_ids)
        if end <= n:
            return self.input_ids[start:end]
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.input_ids[start:] + self.output_ids[:end - n]

    @property
    def to_compute(self) -> int:
        """Tokens whose KV is still missing; 1 for a decoding request."""
        return self.seq_len + self.behind - self.kv.kv_len

    @property
    def sampled(self) -> int:
        """Output tokens sampled so far, folded in or still `behind`."""
        return len(self.output_ids) + self.behind

    @property
    def prefix_limit(self) -> int:
        """How much of the sequence a cache hit may cover: never all of it (the last token
        must run to give logits), never the rows whose input logprobs are owed."""
        limit = self.seq_len - 1
        if self.wants_input_logprobs:
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        return limit

    @property
    def remaining_new_tokens(self) -> int:
        return self.sampling.max_new_tokens - self.sampled

    def take_token(self, token: int, logprob: float | None, top: TopLogprobs | None) -> None:
        self.output_ids.append(token)
        if self.grammar is not None:
            self.grammar.advance(token)
        if logprob is not None:
            self.output_logprobs.append(logprob)
            if top is not None:
                self.output_top.append(top)

    def take_input_logprobs(self, out: SeqOutput, computed: int) -> None:
        """The prompt logprobs a step computed for it (while it `wants_input_logprobs`),
        which left the KV of its first `computed` tokens; once that covers the prompt (but
        the last token, which nothing scores), none are owed."""
        if out.input_logprobs is not None:
            self.input_logprobs.extend(out.input_logprobs)
            self.input_top.extend(out.input_top or [None] * len(out.input_logprobs))
        if computed >= len(self.input_ids) - 1:
            self.wants_input_logprobs = False

    def forget_input_logprobs(self) -> None:
        """Retracted: prompt logprobs not done yet are computed again when it resumes."""
        if self.wants_input_logprobs:
            keep = 1 if self.logprob_start_len == 0 else 0
            del self.input_logprobs[keep:], self.input_top[keep:]

    def inherit_prompt(self, leader: Req) -> None:
        """A sample that forks from (or ends with) its leader has the leader's prompt results."""
        self.input_logprobs, self.input_top = list(leader.input_logprobs), list(leader.input_top)
        self.wants_input_logprobs = leader.wants_input_logprobs
        self.admitted, self.kv.cached_tokens = True, leader.kv.cached_tokens

    def update(self, new_tokens: int) -> RequestUpdate:
        """What the front door needs after a step: the step's `new_tokens` newest tokens
        (several when speculation accepted a draft) and their logprobs, counts, and the
        prompt logprobs once per request (by its first output, with its first tokens or at
        its end; the front door shares them with the request's other outputs)."""
        first = len(self.output_ids) <= max(new_tokens, 1)
        n = -new_tokens if new_tokens else len(self.output_ids)  # the last n; 0: none
        upd = RequestUpdate(
            rid=self.rid, index=self.index, new_token_ids=self.output_ids[n:],
            prompt_tokens=len(self.input_ids), completion_tokens=len(self.output_ids),
            cached_tokens=self.kv.cached_tokens,
            disk_cached_tokens=min(self.kv.disk_tokens, self.kv.cached_tokens),
            finish_reason=self.finish_reason)
        if self.drafts is not None:
            upd.spec_draft_tokens, upd.spec_accepted_tokens = (self.drafts.drafted,
                                                               self.drafts.accepted)
        if self.return_logprob:
            upd.output_logprobs = self.output_logprobs[n:]
            upd.output_top = self.output_top[n:] if self.top_logprobs_num else []
            if (self.index == 0 and self.logprob_start_len >= 0
                    and (first or self.finish_reason is not None)):
                upd.input_logprobs = self.input_logprobs
                upd.input_top = self.input_top if self.top_logprobs_num else None
        return upd


@dataclass(slots=True)
class Fold:
    """What one sampled row did to its request's sequences (`SeqGroup.fold`); the
    scheduler carries it out. Made once per sampled sequence per step: tuples, no lists."""

    sampled: tuple[Req, ...] = ()
    """Sequences that took a token: each may have finished."""
    forks: tuple[tuple[Req, Req], ...] = ()
    """(parent, child): each child a new sequence that is to share its parent's KV."""
    dropped: tuple[Req, ...] = ()
    """Beams not chosen: they end with no answer of their own."""
    search_over: bool = False
    """The beam search is done: its answers are `beam_results(None)`."""


_WAIT = Fold()
"""A beam reported; its siblings have not all yet."""


@dataclass(eq=False)
class SeqGroup:
    """One request's outputs: its unfinished sequences, the samples still to fork from the
    first, and a beam search's state. Each of its sequences points back at it (`Req.group`)."""

    rid: str
    seqs: list[Req]
    """Its unfinished sequences; the request is over once none is left."""
    tenant: str = DEFAULT_TENANT
    """Whose request it is (its share: scheduler/shares.py)."""
    unforked: list[Req] = field(default_factory=list)
    """Parallel samples that fork from `seqs[0]` (the leader) once it has computed the
    prompt: they share its KV and sample their first token from the same logits."""
    search: BeamSearch | None = None
    """The selection state of a beam search, else None."""
    beams: list[Req] = field(default_factory=list)
    """A beam search's running beams, in the order `search` expects their candidates."""
    candidates: dict[Req, BeamCandidates] = field(default_factory=dict)
    """The beams' top continuations from their last step, waiting for the decision."""
    logit_bias: LogitBias | None = None
    """The request's `logit_bias`, packed once for every step's `SeqSampling`."""

    @classmethod
    def of(cls, request: TokenizedRequest, rng: random.Random,
           eos_ids: Collection[int]) -> SeqGroup:
        """The group of a new request: one sequence per sample (a beam search starts from
        one, its prompt, and forks the beams later), each seeded `seed + i`, or from `rng`
        without a seed. A constraint's grammar is set once compiled (`set_grammar`)."""
        base = request.sampling.seed
        seqs = []
        for i in range(1 if request.beam is not None else request.sampling.n):
            seed = rng.getrandbits(62) if base is None else base + i
            req = Req(rid=request.rid, index=i, input_ids=list(request.input_ids),
                      sampling=request.sampling, seed=seed,
                      return_logprob=request.return_logprob,
                      logprob_start_len=request.logprob_start_len,
                      top_logprobs_num=request.top_logprobs_num, namespace=request.namespace,
                      lora=request.lora)
            if req.return_logprob and req.logprob_start_len == 0:
                req.input_logprobs.append(None)  # the first token has no context to score it
                req.input_top.append(None)
            seqs.append(req)
        group = cls(request.rid, seqs, tenant=request.tenant, unforked=seqs[1:])
        if request.sampling.logit_bias:  # keys validated as token ids at the edge
            group.logit_bias = LogitBias.of(request.sampling.logit_bias)
        if request.beam is not None:
            sp, beam = request.sampling, request.beam
            stops = set(sp.stop_token_ids or ()) | (set() if sp.ignore_eos else set(eos_ids))
            group.search = BeamSearch(beam.width, sp.max_new_tokens, beam.length_penalty,
                                      beam.early_stopping, eos_ids=stops)
            group.beams = [seqs[0]]
        for req in seqs:
            req.group = group
        return group

    @property
    def queued_width(self) -> int:
        """The sequences a queued or running member stands for: itself, the samples still
        to fork from it (only the leader is queued while there are any), and the beams a
        beam search's prompt becomes."""
        beams = self.search.beam_width - len(self.beams) if self.search is not None else 0
        return 1 + len(self.unforked) + beams

    def set_grammar(self, grammar: Grammar) -> None:
        for req in self.seqs:  # each sample its own state, from the same grammar
            req.grammar = GrammarState(grammar, req.sampling.ignore_eos, len(self.seqs))

    def fold(self, req: Req, out: SeqOutput) -> Fold:
        """`req`'s sampled row (`out`): a sample takes its token, and the leader's samples
        fork from it with theirs, sampled from the same logits; a beam reports its best
        continuations, and the search moves on once every beam has."""
        if self.search is None:
            req.take_token(out.next_token, out.output_logprob, out.output_top)
            if not self.unforked:
                return Fold((req,))
            forks, self.unforked = self.unforked, []
            for j, fork in enumerate(forks):
                fork.take_token(out.fork_tokens[j],
                                out.fork_logprobs[j] if out.fork_logprobs else None,
                                out.fork_top[j] if out.fork_top else None)
                fork.inherit_prompt(req)
            return Fold((req, *forks), tuple((req, fork) for fork in forks))
        assert out.output_top is not None
        self.candidates[req] = BeamCandidates(out.output_top.token_ids, out.output_top.logprobs)
        return self._advance_beams() if len(self.candidates) == len(self.beams) else _WAIT

    def _advance_beams(self) -> Fold:
        """Every beam has reported: choose the next beams. A beam chosen once goes on in
        place, one chosen again forks, one not chosen drops out. The beams need not all be
        resident at once: one retracted after its step keeps its candidates and waits (in
        `candidates`, admission skips it) until this decision, so searches never block each
        other."""
        assert self.search is not None
        step = self.search.step([self.candidates[b] for b in self.beams])
        self.candidates.clear()
        if step.done:
            return Fold(search_over=True)
        parents, beams = self.beams, []
        forks = []
        taken: set[int] = set()
        for j, p in enumerate(step.parents):
            if p in taken:
                beams.append(self._fork_beam(parents[p], j))
                forks.append((parents[p], beams[-1]))
            else:
                beams.append(parents[p])
                taken.add(p)
        # Only now, after the forks have copied their parents' tokens:
        for j, (beam, token) in enumerate(zip(beams, step.tokens)):
            beam.output_ids.append(token)
            beam.index = j
        self.beams = beams
        return Fold(forks=tuple(forks),
                    dropped=tuple(p for i, p in enumerate(parents) if i not in taken))

    def _fork_beam(self, parent: Req, index: int) -> Req:
        child = Req(rid=parent.rid, index=index, input_ids=parent.input_ids,
                    sampling=parent.sampling, seed=parent.seed,
                    output_ids=list(parent.output_ids), admitted=True,
                    namespace=parent.namespace, lora=parent.lora)  # owes no prompt logprobs
        child.kv.cached_tokens = parent.kv.cached_tokens
        child.group = self
        self.seqs.append(child)
        return child

    def beam_results(self, reason: dict[str, Any] | None) -> list[RequestUpdate]:
        """The answers of a search that is over (`reason` None: its best hypotheses, best
        first) or ended early (`reason`: every output gets it)."""
        assert self.search is not None
        first, search = self.beams[0], self.search
        hyps = search.finish() if reason is None else []
        updates = []
        for i in range(search.beam_width):
            upd = RequestUpdate(rid=self.rid, index=i, prompt_tokens=len(first.input_ids),
                                cached_tokens=first.kv.cached_tokens,
                                finish_reason=reason or {"type": "abort", "message":
                                                         "beam search found no hypothesis"})
            if i < len(hyps):
                h = hyps[i]
                upd.new_token_ids, upd.completion_tokens = h.output_ids, len(h.output_ids)
                upd.score, upd.cumulative_logprob = h.score, h.cum_logprob
                upd.finish_reason = ({"type": "stop", "matched": h.matched}
                                     if h.finish_reason == "stop" else
                                     {"type": "length", "length": search.max_new_tokens})
            updates.append(upd)
        return updates
