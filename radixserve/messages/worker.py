"""The scheduler <-> worker messages (ipc): one step's batch and its result, the worker's
start-up report, and the control calls the worker runs between steps."""

from __future__ import annotations

from array import array
from typing import Any, Literal

from msgspec import Struct

from radixserve.messages.control import ControlReply
from radixserve.messages.rpc import ProfileCall


class LogitBias(Struct, array_like=True, frozen=True):
    """A request's `logit_bias`, packed once when it is admitted: token ids as int32 and
    their values as float32, native byte order. Bytes cross the socket as one copy each
    step and become tensors without a Python list (the worker's `apply_logit_bias`)."""

    ids: bytes
    values: bytes

    @classmethod
    def of(cls, logit_bias: dict[str, float]) -> LogitBias:
        """From `SamplingParams.logit_bias` (keys checked as token ids at the edge)."""
        return cls(array("i", map(int, logit_bias)).tobytes(),
                   array("f", logit_bias.values()).tobytes())


class RowSampling(Struct, array_like=True, frozen=True):
    """A request's sampling parameters: the worker keeps them in its sequence's row from
    the step that first samples it (`ForwardBatch.sampling_edits`) until the row ends."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    """Combined with the output index so a seeded request samples the same tokens in any
    batch."""
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: LogitBias | None = None
    """Values added to these tokens' logits (the request's, packed once: `LogitBias`)."""


class SamplingEdit(Struct, array_like=True):
    """Sequence `seq`'s row holds `params` from this step on."""

    seq: int
    params: RowSampling


class StepSampling(Struct, array_like=True, omit_defaults=True):
    """What the `i`-th sequence of a step samples with besides its row's parameters: sent
    only for a sequence that needs something this step (`ForwardBatch.sample_steps`)."""

    i: int
    step: int = -1
    """The output index it samples (with `RowSampling.seed`); -1: the one after the index
    its row sampled last (the worker counts them)."""
    fork_seeds: list[int] = []
    """Parallel samples that fork from this sequence here: sample the same row once more
    per seed (step 0 of each); their tokens come back in `SeqOutput.fork_tokens`."""
    banned_ids: list[int] = []
    """Tokens that may not be picked this step: EOS and the stop tokens, until the request's
    `min_new_tokens` are out."""
    allowed_mask: bytes | None = None
    """Constrained requests: packed bitmap of the tokens allowed this step (bit i of
    byte i // 8, little-endian bit order); every other token is masked before sampling."""
    draft: list[int] = []
    """Speculative decoding: tokens proposed to follow the sequence's last one, which the
    batch carries after it (its last `len(draft)` input tokens); its `len(draft) + 1` last
    rows are verified (`Sampler.verify`) and what it keeps comes back in `SeqOutput`."""
    draft_masks: list[bytes] = []
    """A constrained request's mask after each draft token (for the rows after the
    first; `allowed_mask` is the first row's)."""
    prompt_ids: list[int] | None = None
    """Tokens the repetition penalty counts besides the outputs: sent with a sequence's
    first sampled step in the worker, which keeps them (`scheduler/worker_rows.py`
    PenaltyTokens)."""
    output_ids: list[int] | None = None
    """With a penalty set: the generated tokens from `output_start` on; the worker keeps
    those before (so the message grows with the new tokens, not the output)."""
    output_start: int = 0


class SeqSampling(Struct, array_like=True):
    """What the sampler needs of one sequence this step: its row's `RowSampling` and the
    step's `StepSampling`, put together by the worker (`worker/seq_rows.py` Sampling)."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    step: int
    fork_seeds: list[int] = []
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    prompt_ids: list[int] | None = None
    output_ids: list[int] | None = None
    """The whole outputs the penalties count (the worker's kept ones and the step's)."""
    banned_ids: list[int] = []
    allowed_mask: bytes | None = None
    logit_bias: LogitBias | None = None
    draft: list[int] = []
    draft_masks: list[bytes] = []

    @classmethod
    def of(cls, params: RowSampling, step: int, extra: StepSampling | None) -> SeqSampling:
        s = cls(params.temperature, params.top_p, params.top_k, params.min_p, params.seed,
                step, frequency_penalty=params.frequency_penalty,
                presence_penalty=params.presence_penalty,
                repetition_penalty=params.repetition_penalty, logit_bias=params.logit_bias)
        if extra is not None:
            s.fork_seeds, s.banned_ids, s.allowed_mask = (extra.fork_seeds, extra.banned_ids,
                                                          extra.allowed_mask)
            s.draft, s.draft_masks = extra.draft, extra.draft_masks
        return s

    def row(self) -> RowSampling:
        """Its row's part (a worker driven without a scheduler: `whole_tables_step`)."""
        return RowSampling(self.temperature, self.top_p, self.top_k, self.min_p, self.seed,
                           self.frequency_penalty, self.presence_penalty,
                           self.repetition_penalty, self.logit_bias)

    def step_part(self, i: int) -> StepSampling:
        """Its step's part, as the `i`-th sequence of a step."""
        return StepSampling(i, self.step, self.fork_seeds, self.banned_ids, self.allowed_mask,
                            self.draft, self.draft_masks, self.prompt_ids, self.output_ids)


class SeqLogprobs(Struct, array_like=True):
    """Which logprobs one sequence wants this step."""

    input_targets: list[int]
    """Token ids scored by the rows `input_start ... input_start + len - 1` of this chunk."""
    input_start: int
    output: bool
    top_n: int


class KVTransfer(Struct, array_like=True):
    """One disk-tier transfer (cache/disk.py): the KV of `blocks` into or out of the disk
    store's entry `entry`, whose file carries `key` (the page hash of its edge's last page)."""

    entry: int
    key: int
    blocks: list[int]


class TableEdit(Struct, array_like=True):
    """A change to one sequence's block table as the worker keeps it: from entry `start`
    on, the table is `blocks` (the entries before `start` stay)."""

    seq: int
    start: int
    blocks: list[int]


class LoraFill(Struct, array_like=True):
    """Load the adapter `name` (one the worker holds) into the device slot `slot`."""

    slot: int
    name: str


class LoraInfo(Struct, kw_only=True):
    """An adapter the worker holds (`lora/adapter.py`)."""

    name: str
    path: str
    fingerprint: str
    """Names its weights and scaling: its KV is cached under it."""
    rank: int
    target_modules: list[str]


PLACEHOLDER = -1
"""An input token not known when the step was sent (`ForwardBatch.placeholders`)."""


class ForwardBatch(Struct, kw_only=True, tag=True):
    """One step for the worker, as changes to the batch it keeps (`worker/seq_rows.py`).

    The worker holds each running sequence's state under the sequence's id across steps
    (each piece of it: `scheduler/worker_rows.py`), such as its block table; a step names
    its sequences by id, with their new tokens and lengths, and sends only what changed
    (`table_edits`: a new sequence's table, appended blocks, a replaced copy-on-write
    tail). So a step whose sequences gained no block
    carries no block table, and the message grows with the batch, not its context.
    Positions and KV slots follow from the lengths and the tables, on the worker.

    With overlap scheduling (scheduler/overlap.py) a step may be sent before the result of
    the one before it is back: a sequence that step samples for then runs on with
    `PLACEHOLDER` as its new token, which the worker fills in on the device from the token
    it kept (`keep_tokens`, then `placeholders`)."""

    seqs: list[int]
    """The step's sequences, by id, in the order of their tokens and results."""
    input_ids: list[int]
    q_lens: list[int]
    kv_lens: list[int]
    """Cached tokens of each sequence after this step; its new tokens are the positions
    `kv_len - q_len ... kv_len - 1`."""
    reset_rows: bool = False
    """Forget every sequence first (the step before failed: what the worker kept is
    unknown to the scheduler, which places every sequence anew)."""
    ended: list[int] = []
    """Sequences the worker forgets (finished, retracted, dropped beams)."""
    table_edits: list[TableEdit] = []
    """Then these changes to the tables, in order; every sequence of the step has a table
    covering its `kv_len`."""
    block_copies: list[tuple[int, int]] = []
    """Copy-on-write: `(src, dst)` whole blocks to copy before this step writes any KV."""
    sampling_edits: list[SamplingEdit] = []
    """Sampling parameters the rows hold from now on: each sequence's on the first step
    that samples it in its row (`scheduler/worker_rows.py` Sampling)."""
    unsampled: list[int] = []
    """Sequences (indices in `seqs`) that sample nothing this step (a prompt chunk but the
    last); every other samples its next token with its row's parameters."""
    sample_steps: list[StepSampling] = []
    """What a sampled sequence needs this step besides its row's parameters, for those that
    need anything (in the order of `seqs`)."""
    logprobs: list[SeqLogprobs | None]
    placeholders: list[int] = []
    """Sequences (indices in `seqs`) whose one new token is `PLACEHOLDER`: the token the
    worker kept for them in the step before (`keep_tokens`)."""
    keep_tokens: list[int] = []
    """Sequences (indices in `seqs`, each sampled plainly: no draft, no fork) whose sampled
    token the worker keeps, on the device, for the next step's placeholder."""
    kv_store: list[KVTransfer] = []
    """Disk tier, done first: save these blocks' KV (freed blocks this step may reuse)."""
    kv_load: list[KVTransfer] = []
    """Then read these entries into their (fresh) blocks; a bad entry is in `kv_failed`."""
    kv_drop: list[int] = []
    """Then delete these entries."""
    kv_sync: bool = False
    """Answer only once every store so far is durable (fsync'd): for a persisted index."""
    lora_fills: list[LoraFill] = []
    """Adapters loaded into device slots before the step (`lora/slots.py`)."""
    lora_slots: list[int] = []
    """Per sequence, the slot of the adapter it runs under (-1: the base model); empty:
    LoRA serving is off."""
    penalized: list[int] = []
    """Sequences (indices in `seqs`) whose `StepSampling` carries the tokens its penalties
    count (`prompt_ids`, `output_ids` from `output_start`): the worker adds them to those
    it keeps and hands the sampler the whole history."""

    def step_sampling(self, i: int) -> StepSampling:
        """The `i`-th sequence's `StepSampling`, added if it has none (a step's sequences
        are built in order, so it is the last one if any)."""
        if not self.sample_steps or self.sample_steps[-1].i != i:
            self.sample_steps.append(StepSampling(i))
        return self.sample_steps[-1]


class TopLogprobs(Struct, array_like=True):
    token_ids: list[int]
    logprobs: list[float]


class SeqOutput(Struct, array_like=True, omit_defaults=True):
    next_token: int = -1
    output_logprob: float | None = None
    output_top: TopLogprobs | None = None
    input_logprobs: list[float] | None = None
    input_top: list[TopLogprobs] | None = None
    fork_tokens: list[int] = []
    """One token per `StepSampling.fork_seeds` entry, sampled from the same row."""
    fork_logprobs: list[float] = []
    fork_top: list[TopLogprobs] = []
    spec_tokens: list[int] = []
    """Speculative decoding: the tokens after `next_token` that the same step verified, in
    order (`next_token` is then the first accepted draft token, or its correction), with
    their logprobs when asked for."""
    spec_logprobs: list[float] = []
    spec_top: list[TopLogprobs] = []


DecodePath = Literal["off", "replayed", "eager"]
"""How a step's forward ran: no CUDA-graph decode, a graph replayed, or eagerly with graphs on."""


class ForwardResult(Struct, kw_only=True):
    outputs: list[SeqOutput]
    forward_seconds: float = 0.0
    shared_runs: int = 0
    """Block runs that tree attention read once for several sequences this step."""
    decode_graph: DecodePath = "off"
    """With CUDA-graph decode on (`worker/cuda_graph.py`): whether the step replayed a
    graph, or ran eagerly (not a plain decode, tree attention, or too wide)."""
    kv_failed: list[int] = []
    """Entries of `kv_load` that could not be read (missing, truncated, corrupted, or not
    the entry asked for): their blocks hold nothing."""
    kv_mappings: int = 0
    """The kernel memory mappings (VMAs) the KV layout's views hold after the step (the
    virtual layout on the CPU; 0 otherwise)."""


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
    architecture: str = ""
    sliding_window: int | None = None
    """The widest layer's window, or None (full attention, or windows the context never
    reaches)."""
    fallbacks: list[str] = []
    """Configured paths this model cannot take, and what runs instead (e.g. tree attention
    off under a sliding window)."""
    kv_fingerprint: str = ""
    """Names the KV format (weights, config, dtype, page size): a disk store written under
    another fingerprint is not this model's KV."""
    disk_load_seconds_per_token: float = 0.0
    """With a disk tier: one token's KV read back from the store, measured at start-up."""
    prefill_seconds_per_token: float = 0.0
    """With a disk tier: one token of prefill, measured at start-up."""
    kv_mapping_budget: int = 0
    """The VMAs the KV layout's views may hold (the virtual layout on the CPU,
    worker/vma_budget.py), which admission keeps (scheduler/mappings.py); 0: no limit."""
    loras: list[LoraInfo] | None = None
    """With LoRA serving on: the adapters loaded at start (`lora_paths`); None: off."""
    tp_size: int = 1
    """Tensor-parallel ranks the model is sharded over (`num_blocks` and `kv_pool_bytes`
    are each rank's: every rank holds its heads' share of the same blocks)."""

    def model_info(self, model: str, served_model_name: str | None = None,
                   cache_events_address: str | None = None) -> dict[str, Any]:
        """What `Api.model_info` answers, one shape for the Engine and the server: the
        facts a caller can use (not the start-up measurements), the names the model is
        served under, and where the cache events are published (None: nowhere)."""
        return {"model_path": self.model_path, "model": model,
                "served_model_name": served_model_name or model,
                "context_length": self.context_length, "vocab_size": self.vocab_size,
                "page_size": self.page_size, "num_blocks": self.num_blocks,
                "max_total_tokens": self.num_blocks * self.page_size, "device": self.device,
                "dtype": self.dtype, "eos_token_ids": self.eos_token_ids,
                "architecture": self.architecture, "sliding_window": self.sliding_window,
                "fallbacks": self.fallbacks, "tp_size": self.tp_size, "is_generation": True,
                "cache_events_address": cache_events_address}


class WorkerReady(Struct, tag=True):
    info: WorkerInfo


class WorkerFailed(Struct, tag=True):
    message: str


class StepResult(Struct, tag=True):
    result: ForwardResult


class ReleaseViewsRequest(Struct, tag=True):
    """The cache was flushed and nothing runs: the worker drops every view its KV layout
    keeps (the virtual layout's mappings). Sent between two steps, as a profile is; the
    flush is answered (`call_id`, the flush's) once the worker has."""

    call_id: int


class LoadLoraRequest(Struct, tag=True):
    """Read an adapter (`LoadLoraCall`), having first forgotten those in `drop` (the
    scheduler's evictions); answered with its `LoraInfo` (an error naming what is wrong with
    it, and nothing dropped, when it cannot be loaded)."""

    call_id: int
    name: str
    path: str
    drop: list[str] = []


class UnloadLoraRequest(Struct, tag=True):
    call_id: int
    name: str


WorkerCall = ProfileCall | ReleaseViewsRequest | LoadLoraRequest | UnloadLoraRequest
"""A control call for the worker, run between steps (`WorkerCalls.run`), under
the scheduler's control id."""

WorkerInput = ForwardBatch | WorkerCall
"""A step, or (between steps) a control call."""

WorkerOutput = WorkerReady | WorkerFailed | StepResult | ControlReply
