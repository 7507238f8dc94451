"""The wire schema: every message that crosses a process boundary, as msgspec Structs.

Only msgspec and the standard library are imported here. Decoders are typed, so a frame
that does not fit its type is rejected with an error naming the field; nothing is pickled.
"""

from __future__ import annotations

from typing import Any

from msgspec import Struct


class SamplingParams(Struct, forbid_unknown_fields=True, kw_only=True):
    """Per-request sampling settings, named as in SGLang. Invalid values raise on construction
    (and on decoding), naming the field."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    regex: str | None = None
    """Constrain the output to match this regular expression (Rust regex syntax, as
    outlines-core reads it): the scheduler masks every token that would break the match."""

    def __post_init__(self) -> None:
        def fail(field: str, rule: str) -> None:
            raise ValueError(f"sampling_params.{field} {rule}, got {getattr(self, field)!r}")

        if self.max_new_tokens < 0:
            fail("max_new_tokens", "must be >= 0")
        if self.temperature < 0:
            fail("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            fail("top_p", "must be in (0, 1]")
        if self.top_k != -1 and self.top_k < 1:
            fail("top_k", "must be -1 (no limit) or >= 1")
        if not 0 <= self.min_p <= 1:
            fail("min_p", "must be in [0, 1]")
        if not -2 <= self.frequency_penalty <= 2:
            fail("frequency_penalty", "must be in [-2, 2]")
        if not -2 <= self.presence_penalty <= 2:
            fail("presence_penalty", "must be in [-2, 2]")
        if not 0 < self.repetition_penalty <= 2:
            fail("repetition_penalty", "must be in (0, 2]")
        if self.n < 1:
            fail("n", "must be >= 1")
        if self.stop is not None and any(s == "" for s in self.stop_strings()):
            fail("stop", "must not contain empty strings")
        if self.stop_token_ids is not None and any(t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be non-negative token ids")
        if self.regex is not None and self.regex == "":
            fail("regex", "must not be empty")  # the scheduler compiles it, naming errors

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.frequency_penalty != 0 or self.presence_penalty != 0
                or self.repetition_penalty != 1)


class TokenizedRequest(Struct, kw_only=True, tag=True):
    """A generate request after tokenization: what the scheduler admits."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    """First prompt position whose logprob is returned; -1 returns output logprobs only."""
    top_logprobs_num: int = 0

    def sample_rids(self) -> list[str]:
        """The scheduler's names for this request's samples: `rid`, or `rid:i` when n > 1."""
        n = self.sampling.n
        return [self.rid] if n == 1 else [f"{self.rid}:{i}" for i in range(n)]


class SeqSampling(Struct, array_like=True):
    """What the sampler needs of one sequence this step."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    """Combined with `step` so a seeded request samples the same tokens in any batch."""
    step: int
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    prompt_ids: list[int] | None = None
    """Tokens the repetition penalty counts besides the outputs (sent only when it is set)."""
    output_ids: list[int] | None = None
    """Generated tokens so far (sent only when a penalty is set)."""
    allowed_mask: bytes | None = None
    """Regex-constrained requests: packed bitmap of the tokens allowed this step (bit i of
    byte i // 8, little-endian bit order); every other token is masked before sampling."""


class SeqLogprobs(Struct, array_like=True):
    """Which logprobs one sequence wants this step."""

    input_targets: list[int]
    """Token ids scored by the rows `input_start ... input_start + len - 1` of this chunk."""
    input_start: int
    output: bool
    top_n: int


class ForwardBatch(Struct, kw_only=True):
    """One step for the worker: flat tokens plus per-sequence paging and sampling."""

    input_ids: list[int]
    positions: list[int]
    q_lens: list[int]
    kv_lens: list[int]
    """Cached tokens of each sequence after this step."""
    block_tables: list[list[int]]
    slot_mapping: list[int]
    sample: list[SeqSampling | None]
    """Per sequence: how to sample its next token, or None for a mid-prompt chunk."""
    logprobs: list[SeqLogprobs | None]


class TopLogprobs(Struct, array_like=True):
    token_ids: list[int]
    logprobs: list[float]


class SeqOutput(Struct, array_like=True, omit_defaults=True):
    next_token: int = -1
    output_logprob: float | None = None
    output_top: TopLogprobs | None = None
    input_logprobs: list[float] | None = None
    input_top: list[TopLogprobs] | None = None


class ForwardResult(Struct, kw_only=True):
    outputs: list[SeqOutput]
    forward_seconds: float = 0.0
    shared_runs: int = 0
    """Block runs that tree attention read once for several sequences this step."""


class WorkerInfo(Struct, kw_only=True):
    """What the worker tells the scheduler once its model and KV pool are ready."""

    model_path: str
    num_blocks: int
    page_size: int
    context_length: int
    vocab_size: int
    eos_token_ids: list[int]
    device: str
    dtype: str
    kv_pool_bytes: int


class RequestUpdate(Struct, kw_only=True, omit_defaults=True):
    """Progress of one request after a step: new tokens, logprobs, and whether it is done.

    With `n` parallel samples, each sample is its own request `rid:index`."""

    rid: str
    new_token_ids: list[int] = []
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: dict[str, Any] | None = None
    output_logprobs: list[float] = []
    output_top: list[TopLogprobs] = []
    input_logprobs: list[float | None] | None = None
    """Sent once, complete, with the first new token (entries from `logprob_start_len`)."""
    input_top: list[TopLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# -- front door <-> scheduler <-> worker (internal, ipc sockets) ---------------------------

class AbortRequest(Struct, tag=True):
    rid: str


class ControlRequest(Struct, tag=True):
    call_id: int
    op: str
    """`flush_cache` or `stats`."""


SchedulerInput = TokenizedRequest | AbortRequest | ControlRequest


class UpdateBatch(Struct, tag=True):
    updates: list[RequestUpdate]


class RequestRejected(Struct, tag=True):
    rid: str
    code: str
    message: str


class ControlReply(Struct, tag=True):
    call_id: int
    payload: dict[str, Any]


class SchedulerReady(Struct, tag=True):
    info: WorkerInfo


SchedulerOutput = UpdateBatch | RequestRejected | ControlReply | SchedulerReady


class WorkerReady(Struct, tag=True):
    info: WorkerInfo


class WorkerFailed(Struct, tag=True):
    message: str


class StepResult(Struct, tag=True):
    result: ForwardResult


WorkerOutput = WorkerReady | WorkerFailed | StepResult


# -- RPC: clients <-> front door (tcp) ---------------------------------------------------
# Every call carries a client-chosen `call_id`; every reply names the call it answers.

class GenerateCall(Struct, tag="generate", kw_only=True, forbid_unknown_fields=True):
    """Same arguments as `Engine.generate`; `text` is the prompt (SGLang's name)."""

    call_id: int
    text: str | list[str] | None = None
    input_ids: list[Any] | None = None
    """A list of token ids, or a list of such lists for a batch."""
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None


class AbortCall(Struct, tag="abort", forbid_unknown_fields=True):
    call_id: int
    rid: str


class FlushCacheCall(Struct, tag="flush_cache", forbid_unknown_fields=True):
    call_id: int


class ModelInfoCall(Struct, tag="model_info", forbid_unknown_fields=True):
    call_id: int


class StatsCall(Struct, tag="stats", forbid_unknown_fields=True):
    call_id: int


class HealthCall(Struct, tag="health", forbid_unknown_fields=True):
    call_id: int


RpcCall = GenerateCall | AbortCall | FlushCacheCall | ModelInfoCall | StatsCall | HealthCall


class ResultReply(Struct, tag="result"):
    call_id: int
    result: Any
    """A generate result dict (or a list for a batch / n > 1), or the control call's answer."""


class ChunkReply(Struct, tag="chunk"):
    """Streaming: new text and token ids of output `index` since its previous chunk."""

    call_id: int
    index: int
    text: str
    token_ids: list[int]


class ErrorReply(Struct, tag="error"):
    call_id: int
    """-1 when the frame was too malformed to tell which call it was."""
    code: str
    """invalid_request, malformed_frame, overloaded, worker_died, not_ready, internal."""
    message: str


RpcReply = ResultReply | ChunkReply | ErrorReply
