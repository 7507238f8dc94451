"""A request as the scheduler tracks it: its tokens, where their KV lives, what it returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from radixserve.messages import RequestUpdate, SamplingParams, TokenizedRequest, TopLogprobs
from radixserve.scheduler.grammar import GrammarState
from radixserve.scheduler.kv_handle import KVHandle
from radixserve.stop_strings import PartialBudget, Stops


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
    """The radix cache namespace of its request (tenant and cache_salt): every lookup and
    insert of its prefixes, and the kept partial blocks, are in it alone."""
    stops: Stops = field(init=False)
    """The stop strings and patterns of `sampling`, compiled."""
    stop_from: int = 0
    """The output token where a stop pattern's match may still begin (scheduler/stop.py):
    each step searches the text from there, not the whole output."""
    stop_budget: PartialBudget = field(default_factory=PartialBudget)
    """Its time left for partial-match searches (`Stops.resume_at`); once spent,
    `stop_from` stays where it is."""

    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    kv: KVHandle = field(init=False)
    """Its KV: blocks, lengths, locked tree node, disk load (changed by scheduler/kv.py)."""
    admitted: bool = False
    input_logprobs_done: bool = False
    finish_reason: dict[str, Any] | None = None
    grammar: GrammarState | None = None
    """The state of a constrained request (see scheduler/grammar.py), else None."""
    forks: list["Req"] = field(default_factory=list)
    """Parallel samples that fork from this one once it has computed the prompt: they share
    its KV and sample their first token from the same logits."""
    beams: Any = None
    """The BeamGroup (scheduler.py) of a beam-search sequence, else None."""
    candidates: Any = None
    """A beam's top continuations from its last step, waiting for the group's decision."""

    input_logprobs: list[float | None] = field(default_factory=list)
    input_top: list[TopLogprobs | None] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[TopLogprobs] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.stops = Stops.of(self.sampling)  # patterns are compiled once per process
        self.kv = KVHandle(self.namespace)

    @classmethod
    def from_tokenized(cls, req: TokenizedRequest, index: int, seed: int) -> "Req":
        return cls(rid=req.rid, index=index, input_ids=list(req.input_ids),
                   sampling=req.sampling, seed=seed, return_logprob=req.return_logprob,
                   logprob_start_len=req.logprob_start_len,
                   top_logprobs_num=req.top_logprobs_num, namespace=req.namespace)

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
        return self.seq_len - self.kv.kv_len

    @property
    def wants_input_logprobs(self) -> bool:
        """Prompt logprobs still owed (they are computed once, never after a retraction)."""
        return (self.return_logprob and self.logprob_start_len >= 0
                and not self.input_logprobs_done)

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
        return self.sampling.max_new_tokens - len(self.output_ids)

    def update(self, new_token: bool) -> RequestUpdate:
        """What the front door needs after a step: the newest token (if `new_token`) and its
        logprobs, counts, and the prompt logprobs once (with the first token, or at the end)."""
        first = len(self.output_ids) <= 1
        upd = RequestUpdate(
            rid=self.rid, index=self.index, new_token_ids=self.output_ids[-1:] if new_token else [],
            prompt_tokens=len(self.input_ids), completion_tokens=len(self.output_ids),
            cached_tokens=self.kv.cached_tokens,
            disk_cached_tokens=min(self.kv.disk_tokens, self.kv.cached_tokens),
            finish_reason=self.finish_reason)
        if self.return_logprob:
            upd.output_logprobs = self.output_logprobs[-1:] if new_token else []
            upd.output_top = self.output_top[-1:] if new_token and self.top_logprobs_num else []
            if self.logprob_start_len >= 0 and (first or self.finish_reason is not None):
                upd.input_logprobs = self.input_logprobs
                upd.input_top = self.input_top if self.top_logprobs_num else None
        return upd
