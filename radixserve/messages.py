"""The wire schema: every message that crosses a process boundary, as msgspec Structs.

Only msgspec, the standard library and the result structs (`radixserve.results`, which
import nothing else of radixserve) are imported here. Decoders are typed, so a frame
that does not fit its type is rejected with an error naming the field; nothing is pickled.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import NODEFAULT, Meta, Struct

from radixserve.results.errors import ErrorCode
from radixserve.results.generate import GenerateResult


MAX_INPUT_IDS = 1 << 20
"""Most token ids in one call's `input_ids` (and most prompts in a batch of them), bounded
by the decoder itself: a frame holding more is refused while it is decoded, before a list
is built. Above any context length served here; the model's own limit is checked next."""

TokenIds = Annotated[list[int], Meta(max_length=MAX_INPUT_IDS)]
InputIds = Annotated[list[int | TokenIds], Meta(max_length=MAX_INPUT_IDS)]
"""A list of token ids, or a batch of such lists (msgspec allows one array type in a
union, so the items are an int or a list; a mixed list is refused at the edge)."""

MAX_BATCH = 1 << 16
"""Most prompts (and `sampling_params` and `rid` entries) in one call, bounded by the
decoder itself: each entry is an object built before anything is checked, so a frame of
millions of empty entries is refused while it is decoded. The server's own limit on a
call's outputs (`max_queued_requests`) is checked next, before any prompt is tokenized."""

Batch = Annotated[list[str], Meta(max_length=MAX_BATCH)]
"""A batch of text prompts, or of rids (one per prompt)."""

CONSTRAINT_FIELDS = ("regex", "json_schema", "ebnf", "structural_tag")
"""The SamplingParams fields that constrain the output; a request takes at most one."""


class SamplingParams(Struct, forbid_unknown_fields=True, kw_only=True):
    """Per-request sampling settings, named as in SGLang. Invalid values raise when decoded
    (a generate call's `sampling_params` are decoded as this type, on every surface) or
    converted (`msgspec.convert`, as the Engine does), naming the field: bounds are
    declared on the fields, the rest is checked in `__post_init__`.

    A null field means its default, as in SGLang, whose clients send nulls: the fields
    below that declare `| None` with another default get it back in `__post_init__`, so
    after construction only those whose default is None may be None."""

    max_new_tokens: Annotated[int, Meta(ge=0)] | None = 128
    temperature: Annotated[float, Meta(ge=0)] | None = 1.0
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = 1.0
    top_k: int | None = -1
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Meta(ge=0)]] | None = None
    ignore_eos: bool | None = False
    seed: int | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = 0.0
    presence_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0, le=2)] | None = 1.0
    skip_special_tokens: bool | None = True
    no_stop_trim: bool | None = False
    n: Annotated[int, Meta(ge=1)] | None = 1
    """Samples of the prompt; at most `max_running_requests`, checked before any work."""
    regex: Annotated[str, Meta(min_length=1)] | None = None
    """Constrain the output to match this regular expression: the scheduler masks every
    token that would break the match (scheduler/grammar.py; xgrammar's dialect: no
    look-around or back-references, `\\d` and `\\w` are ASCII). At most one of `regex`,
    `json_schema`, `ebnf` and `structural_tag` per request."""
    json_schema: Annotated[str, Meta(min_length=1)] | None = None
    """Constrain the output to JSON valid against this schema (the schema as a JSON string,
    as SGLang takes it), written compactly (`", "` and `": "`, no other whitespace); an
    object with `properties` gets no other keys unless `additionalProperties` allows them.
    Any JSON object (OpenAI's `response_format: {"type": "json_object"}`, as SGLang maps
    it) is `'{"type": "object"}'`."""
    ebnf: Annotated[str, Meta(min_length=1)] | None = None
    """Constrain the output to this EBNF grammar (GBNF, as xgrammar and llama.cpp read it;
    the start rule is `root`)."""
    structural_tag: Annotated[str, Meta(min_length=1)] | None = None
    """A JSON string: SGLang's `{"type": "structural_tag", "structures": [{"begin",
    "schema", "end"}], "triggers": [...]}` (free text, and after a trigger a tag whose body
    follows its schema), or xgrammar's `{"type": "structural_tag", "format": {...}}`."""
    min_new_tokens: Annotated[int, Meta(ge=0)] | None = 0
    """Until this many tokens are out, EOS and stop tokens cannot be picked and nothing
    stops the request (but `max_new_tokens`, which must be at least this, or a `regex`
    match that cannot grow)."""
    stop_regex: str | list[str] | None = None
    """Stop when the output text matches one of these (Python `re`) patterns; the text is
    cut before the match (after it with `no_stop_trim`), and the finish reason's `matched`
    names the pattern, as in SGLang. Patterns are checked at the edge (stop_strings.py)."""
    logit_bias: dict[str, Annotated[float, Meta(ge=-100, le=100)]] | None = None
    """Token id (as a string, as OpenAI and SGLang key it) -> value added to its logit
    before sampling, greedy rows included; -100 bans the token, 100 all but forces it.
    The ids are checked against the vocabulary at the edge (scheduler/validate.py)."""
    spaces_between_special_tokens: bool | None = True
    """Passed to the tokenizer's decode with `skip_special_tokens`, as SGLang does (fast
    tokenizers, such as the default model's, decode the same either way)."""
    sampling_seed: int | None = None
    """SGLang's other name for `seed`; passing both with different values is an error."""
    beam_width: Annotated[int, Meta(ge=1, le=64)] | None = None
    """SGLang's spelling of beam search: `beam_width` > 1 runs radixserve's beam search,
    and the answer is shaped as SGLang's (the best beam, and the first `n` beams in
    `meta_info.beam_results`, `n` <= `beam_width`)."""
    stream_interval: int | None = None
    """SGLang's streaming granularity: no meaning here (a stream sends every token). Listed
    in the result's `meta_info.ignored_params` when set."""
    custom_params: dict[str, Any] | None = None
    """Arguments of SGLang's custom logit processors, which radixserve does not run. Listed
    in the result's `meta_info.ignored_params` when set."""
    watermark: Any = None
    """SGLang's output watermarking, which would change the output: an error when set
    (but `{"enabled": false}`)."""

    def __post_init__(self) -> None:
        for name, default in _NULL_MEANS_DEFAULT:
            if getattr(self, name) is None:
                setattr(self, name, default)

        def fail(field: str, rule: str) -> None:
            raise ValueError(f"sampling_params.{field} {rule}, got {getattr(self, field)!r}")

        if self.top_k != -1 and self.top_k < 1:
            fail("top_k", "must be -1 (no limit) or >= 1")
        if self.stop is not None and any(s == "" for s in self.stop_strings()):
            fail("stop", "must not contain empty strings")
        if self.min_new_tokens > self.max_new_tokens:
            fail("min_new_tokens", f"must be at most max_new_tokens ({self.max_new_tokens})")
        if self.sampling_seed is not None:
            if self.seed is not None and self.seed != self.sampling_seed:
                fail("sampling_seed", f"is another name for seed, which is {self.seed}")
            self.seed = self.sampling_seed
        if self.watermark is not None and self.watermark != {"enabled": False}:
            raise ValueError("sampling_params.watermark is not supported by radixserve (it "
                             'would change the output): pass none, or {"enabled": false}')
        if self.beam_search and self.n > self.beam_width:
            fail("n", f"counts the beams returned, at most beam_width ({self.beam_width})")
        used = [f for f in CONSTRAINT_FIELDS if getattr(self, f) is not None]
        if len(used) > 1:
            raise ValueError(f"sampling_params.{used[0]} and sampling_params.{used[1]} cannot "
                             "be combined: pass at most one output constraint")

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def ignored_params(self) -> list[str]:
        """The SGLang settings this request sets that mean nothing here (its results list
        them, so that nothing is ignored silently)."""
        return [name for name in ("stream_interval", "custom_params")
                if getattr(self, name) is not None]

    @property
    def beam_search(self) -> bool:
        return self.beam_width is not None and self.beam_width > 1

    @property
    def constraint(self) -> tuple[str, str] | None:
        """The output constraint as (field name, text), or None (scheduler/grammar.py)."""
        for field in CONSTRAINT_FIELDS:
            text = getattr(self, field)
            if text is not None:
                return field, text
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.frequency_penalty != 0 or self.presence_penalty != 0
                or self.repetition_penalty != 1)


_NULL_MEANS_DEFAULT = [(f.name, f.default) for f in msgspec.structs.fields(SamplingParams)
                       if f.default not in (None, NODEFAULT)]


SamplingParamsArg = SamplingParams | Annotated[list[SamplingParams],
                                               Meta(max_length=MAX_BATCH)] | None
"""A generate call's `sampling_params`: one for every prompt, or one per prompt of a
batch. Decoded as SamplingParams, so a bad or unknown field is refused with the call,
naming it, and a nested value at its first level (a client sends a map, as before)."""


class BeamParams(Struct, forbid_unknown_fields=True, kw_only=True):
    """Beam search as transformers' `generate(num_beams=width, do_sample=False)` does it."""

    width: Annotated[int, Meta(ge=1, le=64)] = 4
    length_penalty: float = 1.0
    """A finished beam scores `sum(logprobs) / generated_tokens ** length_penalty`."""
    early_stopping: bool | Literal["never"] = False


def beam_arguments(beam_width: int, max_new_tokens: int, length_penalty: float,
                   early_stopping: bool | str, ignore_eos: bool, stop_token_ids: list[int] | None,
                   skip_special_tokens: bool) -> dict[str, Any]:
    """The generate arguments of a beam-search call (Engine and clients alike)."""
    return {"sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": ignore_eos,
                                "stop_token_ids": stop_token_ids,
                                "skip_special_tokens": skip_special_tokens},
            "beam": {"width": beam_width, "length_penalty": length_penalty,
                     "early_stopping": early_stopping}}


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

    @property
    def num_outputs(self) -> int:
        """How many answers this request gives: its `n` samples, or its beams. Output `i` is
        named `(rid, i)` in every update; nothing parses a rid."""
        return self.beam.width if self.beam is not None else self.sampling.n



class SeqSampling(Struct, array_like=True):
    """What the sampler needs of one sequence this step."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    """Combined with `step` so a seeded request samples the same tokens in any batch."""
    step: int
    fork_seeds: list[int] = []
    """Parallel samples that fork from this sequence here: sample the same row once more
    per seed (step 0 of each); their tokens come back in `SeqOutput.fork_tokens`."""
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    prompt_ids: list[int] | None = None
    """Tokens the repetition penalty counts besides the outputs (sent only when it is set)."""
    output_ids: list[int] | None = None
    """Generated tokens so far (sent only when a penalty is set)."""
    banned_ids: list[int] = []
    """Tokens that may not be picked this step: EOS and the stop tokens, until the request's
    `min_new_tokens` are out."""
    allowed_mask: bytes | None = None
    """Constrained requests: packed bitmap of the tokens allowed this step (bit i of
    byte i // 8, little-endian bit order); every other token is masked before sampling."""
    bias_ids: list[int] = []
    """`logit_bias` as parallel lists: these tokens' logits get `bias_values` added."""
    bias_values: list[float] = []


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


class ForwardBatch(Struct, kw_only=True, tag=True):
    """One step for the worker: flat tokens plus per-sequence paging and sampling."""

    input_ids: list[int]
    positions: list[int]
    q_lens: list[int]
    kv_lens: list[int]
    """Cached tokens of each sequence after this step."""
    block_tables: list[list[int]]
    slot_mapping: list[int]
    block_copies: list[tuple[int, int]] = []
    """Copy-on-write: `(src, dst)` whole blocks to copy before this step writes any KV."""
    sample: list[SeqSampling | None]
    """Per sequence: how to sample its next token, or None for a mid-prompt chunk."""
    logprobs: list[SeqLogprobs | None]
    kv_store: list[KVTransfer] = []
    """Disk tier, done first: save these blocks' KV (freed blocks this step may reuse)."""
    kv_load: list[KVTransfer] = []
    """Then read these entries into their (fresh) blocks; a bad entry is in `kv_failed`."""
    kv_drop: list[int] = []
    """Then delete these entries."""
    kv_sync: bool = False
    """Answer only once every store so far is durable (fsync'd): for a persisted index."""


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
    """One token per `SeqSampling.fork_seeds` entry, sampled from the same row."""
    fork_logprobs: list[float] = []
    fork_top: list[TopLogprobs] = []


class ForwardResult(Struct, kw_only=True):
    outputs: list[SeqOutput]
    forward_seconds: float = 0.0
    shared_runs: int = 0
    """Block runs that tree attention read once for several sequences this step."""
    kv_failed: list[int] = []
    """Entries of `kv_load` that could not be read (missing, truncated, corrupted, or not
    the entry asked for): their blocks hold nothing."""


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
    finish_reason: dict[str, Any] | None = None
    output_logprobs: list[float] = []
    output_top: list[TopLogprobs] = []
    input_logprobs: list[float | None] | None = None
    """Sent once, complete, with the first new token (entries from `logprob_start_len`)."""
    input_top: list[TopLogprobs | None] | None = None
    score: float | None = None
    """Beam search: the beam's length-normalised score (transformers' `sequences_scores`)."""
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# -- front door <-> scheduler <-> worker (internal, ipc sockets) ---------------------------

class AbortRequest(Struct, tag=True):
    """Abort every output of the request named `rid` (exactly that rid)."""

    rid: str


class FlushCacheRequest(Struct, tag=True):
    call_id: int


class StatsRequest(Struct, tag=True):
    call_id: int


class ProfileRequest(Struct, tag=True):
    """Start or stop a torch.profiler trace of the worker's steps (SGLang's /start_profile
    and /stop_profile). The scheduler passes it on to the worker between two steps."""

    call_id: int
    action: Literal["start", "stop"]
    output_dir: str | None = None
    """Where the stopped trace is written (the worker's machine): the front door's profile
    directory or a name inside it (server/admin.py); None (the Engine): a temp folder."""


class CacheSnapshotRequest(Struct, tag=True):
    """Every page hash in the tree now (a router's resync; see CacheEvents)."""

    call_id: int


class PinRequest(Struct, tag=True):
    """Pin `request.input_ids`' whole pages in `request.namespace` (see scheduler/pins.py):
    answered at once when they are cached, else after `request` (max_new_tokens 0, a rid
    no client uses) has prefilled them. `ttl`: seconds until the pin lapses (None: never)."""

    call_id: int
    request: TokenizedRequest
    ttl: float | None = None
    owner: str | None = None
    """The tenant the pin counts against (front door's tag for it), or None: the
    operator's, bounded by `max_pinned_tokens` alone. Answers give the owner's total."""
    quota: int | None = None
    """Most tokens the owner's pins may hold together (`--max-pinned-tokens-per-tenant`)."""


class CacheScope(Struct, array_like=True, frozen=True):
    """The cache namespaces a caller may see: every one when `prefix` is None, else those
    whose name starts with it (a tenant's: tenants.tenant_namespace_prefix), and the
    default namespace when `include_default`."""

    prefix: str | None = None
    include_default: bool = True

    def admits(self, namespace: str | None) -> bool:
        if self.prefix is None:
            return True
        return self.include_default if namespace is None else namespace.startswith(self.prefix)


class UnpinRequest(Struct, tag=True):
    """Drop the pin of `input_ids`' whole pages in `namespace`; with `every`, instead
    every pin in `scope`."""

    call_id: int
    input_ids: list[int] = []
    namespace: str | None = None
    every: bool = False
    scope: CacheScope = CacheScope()
    owner: str | None = None
    """As PinRequest's: whose pinned total the answer gives (None: every pin's)."""


class CacheInfoRequest(Struct, tag=True):
    """The tree summarised (cache/summary.py) with the pins, in the namespaces of `scope`."""

    call_id: int
    top: int = 20
    scope: CacheScope = CacheScope()


SchedulerInput = (TokenizedRequest | AbortRequest | FlushCacheRequest | StatsRequest
                  | ProfileRequest | CacheSnapshotRequest | PinRequest | UnpinRequest
                  | CacheInfoRequest)


class UpdateBatch(Struct, tag=True):
    updates: list[RequestUpdate]


class RequestRejected(Struct, tag=True):
    """The scheduler refused the request named `rid` (all of its outputs)."""

    rid: str
    code: str
    message: str


class ControlReply(Struct, tag=True):
    call_id: int
    payload: dict[str, Any]
    error: str | None = None
    """Set when the control call was refused (e.g. a profile stopped that never started)."""


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


SchedulerOutput = UpdateBatch | RequestRejected | ControlReply | SchedulerReady | CacheEvents


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


WorkerCall = ProfileRequest | ReleaseViewsRequest
"""A control call for the worker, run between steps (`EngineCore.run_worker_calls`)."""

WorkerInput = ForwardBatch | WorkerCall

WorkerOutput = WorkerReady | WorkerFailed | StepResult | ControlReply


# -- RPC: clients <-> front door (tcp) ---------------------------------------------------
# Every call carries a client-chosen `call_id`; every reply names the call it answers.
# With API keys configured (`--api-key`), every call but health carries `api_key`, the
# caller's tenant token, checked as the HTTP bearer key is; a call without a valid one is
# answered `unauthorized`. Without keys it is ignored.

class GenerateCall(Struct, tag="generate", kw_only=True, forbid_unknown_fields=True):
    """Same arguments as `Engine.generate`; `text` is the prompt (SGLang's name)."""

    call_id: int
    text: str | Batch | None = None
    input_ids: InputIds | None = None
    """A list of token ids, or a list of such lists for a batch (`MAX_INPUT_IDS` each)."""
    sampling_params: SamplingParamsArg = None
    return_logprob: bool = False
    logprob_start_len: Annotated[int, Meta(ge=-1)] = -1
    top_logprobs_num: Annotated[int, Meta(ge=0)] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | Batch | None = None
    beam: BeamParams | None = None
    """Beam search (`Client.beam_search`): the result lists the beams, best first."""
    cache_salt: str | None = None
    """Narrows the radix cache namespace within the caller's tenant: only requests of the
    same tenant with the same salt share cached prefixes (vLLM's and SGLang's name)."""
    api_key: str | None = None


class AbortCall(Struct, tag="abort", forbid_unknown_fields=True):
    """With API keys, a caller aborts only its own tenant's requests."""

    call_id: int
    rid: str
    api_key: str | None = None


class FlushCacheCall(Struct, tag="flush_cache", forbid_unknown_fields=True):
    call_id: int
    api_key: str | None = None


class ModelInfoCall(Struct, tag="model_info", forbid_unknown_fields=True):
    call_id: int
    api_key: str | None = None


class StatsCall(Struct, tag="stats", forbid_unknown_fields=True):
    call_id: int
    api_key: str | None = None


class HealthCall(Struct, tag="health", forbid_unknown_fields=True):
    call_id: int
    api_key: str | None = None


class ProfileCall(Struct, tag="profile", forbid_unknown_fields=True):
    """Start or stop a torch.profiler trace of the worker (see ProfileRequest); the
    operator's call. Traces go to the server's `--profile-dir`."""

    call_id: int
    action: Literal["start", "stop"]
    output_dir: str | None = None
    """A subdirectory of the server's profile directory: one plain name, not a path."""
    api_key: str | None = None


class CacheSnapshotCall(Struct, tag="cache_snapshot", forbid_unknown_fields=True):
    """The replica's whole tree as page hashes: `{"epoch", "seq", "page_size", "hashes",
    "load"}`, where `seq` is that of the last CacheEvents sent before it (see CacheEvents)."""

    call_id: int
    api_key: str | None = None


class WorkersCall(Struct, tag="workers", forbid_unknown_fields=True):
    """A router's replicas (SGLang router's /add_worker, /remove_worker, /list_workers):
    `url` is a replica's RPC address. A server answers invalid_request."""

    call_id: int
    action: Literal["add", "remove", "list"]
    url: str | None = None
    api_key: str | None = None


MAX_PIN_TTL = 10 * 365 * 24 * 3600.0
"""Longest `ttl` of a pin, in seconds (ten years; no ttl at all pins until unpinned)."""


class PinCall(Struct, tag="pin", kw_only=True, forbid_unknown_fields=True):
    """Keep a prefix (`text` or `input_ids`, its whole pages) in memory, prefilling it
    first if it is not cached, until `UnpinCall` or `ttl` seconds. It lives in the
    caller's namespace (tenant and `cache_salt`), as a generate call's prefixes do.
    Answer: `{"tokens", "expires_in", "tier", "pinned_tokens"}` (pinned_tokens: the
    caller's tenant's pins' tokens now; the operator's: all pins'); refused past
    `--max-pinned-tokens`, or a tenant's past `--max-pinned-tokens-per-tenant` or with a
    `ttl` past `--max-pin-ttl`. A router refuses it (send it to a replica)."""

    call_id: int
    text: str | None = None
    input_ids: TokenIds | None = None
    ttl: Annotated[float, Meta(gt=0, le=MAX_PIN_TTL)] | None = None
    cache_salt: str | None = None
    api_key: str | None = None


class UnpinCall(Struct, tag="unpin", kw_only=True, forbid_unknown_fields=True):
    """Drop the pin of exactly this prefix in the caller's namespace, or with `all` (and
    no prefix) every pin the caller may see (its tenant's, as `CacheInfoCall` shows them).
    Answer: `{"unpinned": bool, "pins", "tokens", "pinned_tokens"}` (unpinned false: there
    was none; pins and tokens: what was dropped; pinned_tokens: what the caller's tenant's
    pins hold now, the operator's: all pins)."""

    call_id: int
    text: str | None = None
    input_ids: TokenIds | None = None
    cache_salt: str | None = None
    all: bool = False
    api_key: str | None = None


class CacheInfoCall(Struct, tag="cache_info", kw_only=True, forbid_unknown_fields=True):
    """The radix tree summarised for a person: its `top` largest and hottest prefixes
    (with their ancestors) with the first words of their text, and totals per tier; with
    API keys, only the caller's tenant's namespaces. See docs/rpc.md for the fields."""

    call_id: int
    top: Annotated[int, Meta(ge=0, le=1000)] = 20
    api_key: str | None = None


RpcCall = (GenerateCall | AbortCall | FlushCacheCall | ModelInfoCall | StatsCall | HealthCall
           | ProfileCall | CacheSnapshotCall | WorkersCall | PinCall | UnpinCall
           | CacheInfoCall)

OPERATOR_CALLS = (FlushCacheCall, ProfileCall, CacheSnapshotCall, WorkersCall)
"""The calls only the operator may make (tenants.Tenants.is_operator); anyone else's is
answered `forbidden`, by a server and a router alike."""


class ResultReply(Struct, tag="result"):
    call_id: int
    result: GenerateResult | dict[str, Any]
    """A generate call's outputs, or a control call's answer (not yet typed)."""


class ChunkReply(Struct, tag="chunk"):
    """Streaming: new text and token ids of output `index` since its previous chunk."""

    call_id: int
    index: int
    text: str
    token_ids: list[int]


class ErrorReply(Struct, tag="error"):
    call_id: int
    """-1 when the frame was too malformed to tell which call it was."""
    code: ErrorCode
    """Why (see `results.errors`: each code's meaning and HTTP status)."""
    message: str


RpcReply = ResultReply | ChunkReply | ErrorReply


def decode(decoder: msgspec.msgpack.Decoder | msgspec.json.Decoder, data: Any) -> Any:
    """`decoder.decode(data)` for bytes from another process or a caller, which every
    socket and body decodes through: bytes that nest arrays or maps deeper than the
    interpreter's recursion limit (~1000 levels; a frame of a few KB) raise
    `msgspec.DecodeError`, as any other undecodable bytes do, not `RecursionError`, which
    no receive loop expects. Typed fields refuse a nested value at its first level; this
    bounds the few `Any` ones (and what a `__post_init__` does with them)."""
    try:
        return decoder.decode(data)
    except RecursionError:
        raise msgspec.DecodeError("arrays or maps nested too deeply") from None


def error_text(e: msgspec.DecodeError) -> str:
    """A decode error as callers read it: the field as they named it (`$.a.b` -> `a.b`)."""
    return str(e).replace(" - at `$`", "").replace("`$.", "`")
