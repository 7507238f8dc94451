"""The front door <-> scheduler messages (ipc): tokenized requests and control operations
in; token updates, refusals, control answers, readiness and cache events out."""

from __future__ import annotations

from msgspec import Struct

from radixserve.messages.control import Control, ControlReply
from radixserve.messages.kv_events import KVEvent
from radixserve.messages.sampling import BeamParams, SamplingParams
from radixserve.messages.worker import TopLogprobs, WorkerInfo
from radixserve.results.errors import ErrorCode
from radixserve.tenants import DEFAULT_TENANT


class TokenizedRequest(Struct, kw_only=True, tag=True):
    """A generate request after tokenization: what the scheduler admits."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    """First prompt position whose logprob is returned; -1 returns output logprobs only."""
    top_logprobs_num: int = 0
    beam: BeamParams | None = None
    """Beam search instead of sampling: the request's outputs are its best beams."""
    namespace: str | None = None
    """The radix cache namespace the request's prefixes are looked up in and inserted
    into: None (the default) or an opaque string the front door derives from the caller's
    tenant and `cache_salt` (server/tenants.py); never chosen by a client."""
    tenant: str = DEFAULT_TENANT
    """Whose request it is: the scheduler keeps each tenant to its share of the queue and
    of the batch (scheduler/shares.py)."""
    lora: str | None = None
    """The LoRA adapter it runs under, by name (None: the base model); the scheduler adds
    the adapter's fingerprint to `namespace` (lora/adapter.py `cache_namespace`)."""

    @property
    def num_outputs(self) -> int:
        """How many answers this request gives: its `n` samples, or its beams. Output `i` is
        named `(rid, i)` in every update; nothing parses a rid."""
        return self.beam.width if self.beam is not None else self.sampling.n


class RequestUpdate(Struct, kw_only=True, omit_defaults=True):
    """Progress of one output of a request after a step: new tokens, logprobs, and whether
    it is done. An output is named by the request's `rid` and its `index` (the sample, or
    the beam's rank), never by a composed string."""

    rid: str
    index: int = 0
    new_token_ids: list[int] = []
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    disk_cached_tokens: int = 0
    """Of `cached_tokens`, those loaded back from the disk tier for this request."""
    finish_reason: dict[str, str | int | None] | None = None
    """`{"type": "stop", "matched": token id, string or None}`, `{"type": "length",
    "length": n}` or `{"type": "abort", "message": text}`; None while it runs."""
    output_logprobs: list[float] = []
    output_top: list[TopLogprobs] = []
    input_logprobs: list[float | None] | None = None
    """Sent once per request, complete, with its output 0's first new token (entries from
    `logprob_start_len`); the front door shares them with the request's other outputs."""
    input_top: list[TopLogprobs | None] | None = None
    score: float | None = None
    """Beam search: the beam's length-normalised score (transformers' `sequences_scores`)."""
    cumulative_logprob: float | None = None
    spec_draft_tokens: int = 0
    """Speculative decoding: tokens drafted for this output so far, and of them accepted."""
    spec_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


SchedulerInput = TokenizedRequest | Control


class UpdateBatch(Struct, tag=True):
    updates: list[RequestUpdate]


class RequestRejected(Struct, tag=True):
    """The scheduler refused the request named `rid` (all of its outputs)."""

    rid: str
    code: ErrorCode
    message: str


class SchedulerReady(Struct, tag=True):
    info: WorkerInfo


class ReplicaLoad(Struct, array_like=True, frozen=True):
    """How busy a replica's scheduler is, for a router's load balancing."""

    waiting_requests: int = 0
    running_requests: int = 0
    waiting_tokens: int = 0
    """Prompt tokens of the queued requests not yet prefilled."""
    running_tokens: int = 0
    """Tokens held in KV by the running requests (their contexts)."""

    @property
    def tokens(self) -> int:
        return self.waiting_tokens + self.running_tokens


class CacheEvents(Struct, tag=True, kw_only=True):
    """What entered and left one replica's radix tree since the previous CacheEvents, with
    its load. The scheduler sends one after a step that changed either (and one a second
    when idle, as a heartbeat); the front door publishes it unchanged on its PUB socket
    (`model_info()["cache_events_address"]`), one frame, no topic.

    Hashes are `radixserve.cache.events.page_hashes` of whole pages, in the namespace the
    request was cached in. A subscriber applies `cleared`, then `removed`, then `stored`.
    `seq` counts 1, 2, ... within an `epoch` (a random id per scheduler start: a restarted
    replica's tree is empty). A gap in `seq`, a new epoch or a late join: ask for a
    snapshot (`CacheSnapshotCall`), keep the events with a larger `seq` than it has."""

    epoch: str
    seq: int
    page_size: int
    stored: list[int] = []
    removed: list[int] = []
    cleared: bool = False
    """The tree was emptied (flush_cache) before `removed` and `stored` happened."""
    load: ReplicaLoad = ReplicaLoad()
    blocks: list[KVEvent] = []
    """With `kv_events` on: the same changes as vLLM's KV events (messages/kv_events.py),
    which the front door publishes on their own socket (never on this one's)."""


SchedulerOutput = UpdateBatch | RequestRejected | ControlReply | SchedulerReady | CacheEvents
