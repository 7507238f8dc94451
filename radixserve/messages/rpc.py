"""The RPC messages: clients <-> front door (tcp), and a router <-> its replicas.

Every call carries a client-chosen `call_id`; every reply names the call it answers. With
API keys configured (`--api-key`), every call but health carries `api_key`, the caller's
tenant token, checked as the HTTP bearer key is; a call without a valid one is answered
`unauthorized`. Without keys it is ignored. docs/rpc.md describes the protocol.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from radixserve.messages.fields import (MAX_BATCH, Batch, CacheSalt, InputIds, JsonObject,
                                        TokenIds)
from radixserve.messages.sampling import BeamParams, SamplingParamsArg
from radixserve.results.errors import ErrorCode
from radixserve.results.generate import GenerateResult


LoraName = Annotated[str, Meta(max_length=128)]
LoraNames = LoraName | Annotated[list[LoraName | None], Meta(max_length=MAX_BATCH)]


class GenerateArgs(Struct, kw_only=True, forbid_unknown_fields=True):
    """The generate operation's arguments, declared once: the RPC call (`GenerateCall`)
    and SGLang's HTTP body (server/http/native.py) are this with their transport's fields.
    Same arguments as `Engine.generate`; `text` is the prompt (SGLang's name)."""

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
    cache_salt: CacheSalt | None = None
    """Narrows the radix cache namespace within the caller's tenant: only requests of the
    same tenant with the same salt share cached prefixes (vLLM's and SGLang's name)."""
    lora_name: LoraNames | None = None
    """The LoRA adapter to run under, by the name it was loaded as (`LoadLoraCall`'s
    `lora_name`), or one per prompt of a batch (None entries: the base model); None: the
    base model. SGLang's /generate body calls it `lora_path` (server/http/native.py)."""


class GenerateCall(GenerateArgs, tag="generate", kw_only=True, forbid_unknown_fields=True):
    call_id: int
    beam: BeamParams | None = None
    """Beam search (`Client.beam_search`): the result lists the beams, best first. Not in
    SGLang's HTTP body, which spells it `sampling_params.beam_width`."""
    api_key: str | None = None


class AbortCall(Struct, tag="abort", forbid_unknown_fields=True):
    """Abort the request `rid`, or with `abort_all` every request in flight. With API keys,
    a caller aborts only its own tenant's requests; the operator aborts every tenant's, or
    with `tenant` that tenant's only (server/admin.py:abort_scope)."""

    call_id: int
    rid: str = ""
    api_key: str | None = None
    abort_all: bool = False
    tenant: str | None = None


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
    """Start or stop a torch.profiler trace of the worker's steps (SGLang's /start_profile
    and /stop_profile); the operator's call. Traces go to the server's `--profile-dir`.
    The scheduler passes it on to the worker between two steps."""

    call_id: int
    action: Literal["start", "stop"]
    output_dir: str | None = None
    """A subdirectory of the server's profile directory: one plain name, not a path
    (past the front door: the folder itself, or None for a temp one; see ControlOp)."""
    api_key: str | None = None


class CacheSnapshotCall(Struct, tag="cache_snapshot", forbid_unknown_fields=True):
    """The replica's whole tree as page hashes: `{"epoch", "seq", "page_size", "hashes",
    "load"}`, where `seq` is that of the last CacheEvents sent before it (see CacheEvents)."""

    call_id: int
    api_key: str | None = None
    blocks: bool = False
    """With `kv_events` on: `blocks`, the tree as vLLM's KV events (parents first), in
    place of `hashes`."""


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
    cache_salt: CacheSalt | None = None
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
    cache_salt: CacheSalt | None = None
    all: bool = False
    api_key: str | None = None


class CacheInfoCall(Struct, tag="cache_info", kw_only=True, forbid_unknown_fields=True):
    """The radix tree summarised for a person: its `top` largest and hottest prefixes
    (with their ancestors) with the first words of their text, and totals per tier; with
    API keys, only the caller's tenant's namespaces. See docs/rpc.md for the fields."""

    call_id: int
    top: Annotated[int, Meta(ge=0, le=1000)] = 20
    api_key: str | None = None


class LoadLoraCall(Struct, tag="load_lora_adapter", forbid_unknown_fields=True):
    """Load the PEFT LoRA adapter at `lora_path` (a directory on the server's machine) as
    `lora_name` (SGLang's /load_lora_adapter); the operator's call. Past
    `--max-loaded-loras` the least recently used adapter no request uses is unloaded first.
    Answer: the adapter (`name`, `path`, `fingerprint`, `rank`, `target_modules`) and
    `unloaded`, the names evicted for it."""

    call_id: int
    lora_name: LoraName
    lora_path: Annotated[str, Meta(max_length=4096)]
    api_key: str | None = None


class UnloadLoraCall(Struct, tag="unload_lora_adapter", forbid_unknown_fields=True):
    """Unload the adapter `lora_name`: refused while a request runs or waits under it;
    requests naming it are refused from now on. The operator's call."""

    call_id: int
    lora_name: LoraName
    api_key: str | None = None


class LorasCall(Struct, tag="lora_adapters", forbid_unknown_fields=True):
    """The adapters loaded now, each `{"name", "path", "fingerprint", "rank",
    "target_modules"}`, least recently used first (paths shown to the operator only)."""

    call_id: int
    api_key: str | None = None


class Envelope(Struct, array_like=True, forbid_unknown_fields=True):
    """What goes before a call of more than MAX_BARE_CALL_BYTES, in a ZeroMQ frame of its
    own: the call's id and the caller's key. A server reads it first and decodes the call
    (the next frame) only for a key it knows: an unauthenticated caller's large call costs
    its bytes read and nothing more (transport/replies.py). The call's own `api_key` is
    taken from here."""

    call_id: int
    api_key: str | None = None


MAX_ENVELOPE_BYTES = 4096
"""An envelope frame larger than this is refused unread."""
MAX_BARE_CALL_BYTES = 4096
"""A call frame of at most this many bytes may travel alone, its key inside it: a server
decodes it for any caller (a health call needs no key; the decode of so little costs
nothing). A larger one goes after its `Envelope`, and is decoded only for a known key."""

RpcCall = (GenerateCall | AbortCall | FlushCacheCall | ModelInfoCall | StatsCall | HealthCall
           | ProfileCall | CacheSnapshotCall | WorkersCall | PinCall | UnpinCall
           | CacheInfoCall | LoadLoraCall | UnloadLoraCall | LorasCall)

OPERATOR_CALLS = (FlushCacheCall, ProfileCall, CacheSnapshotCall, WorkersCall, LoadLoraCall,
                  UnloadLoraCall)
"""The calls only the operator may make (tenants.Tenants.is_operator); anyone else's is
answered `forbidden`, by a server and a router alike."""


class ResultReply(Struct, tag="result"):
    call_id: int
    result: GenerateResult | JsonObject
    """A generate call's outputs (`radixserve.results`), or a control call's answer."""


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
    """Why (see `radixserve.results.errors`: each code's meaning and HTTP status)."""
    message: str


RpcReply = ResultReply | ChunkReply | ErrorReply


def decode(decoder: msgspec.msgpack.Decoder | msgspec.json.Decoder, data: Any) -> Any:
    """`decoder.decode(data)` for bytes from another process or a caller, which every
    socket, body and saved index decodes through (tests/test_wire.py checks that no
    module calls a decoder's own `decode`): bytes that nest arrays or maps deeper than the
    interpreter's recursion limit (~1000 levels; a frame of a few KB) raise
    `msgspec.DecodeError`, as any other undecodable bytes do, not `RecursionError`, which
    no receive loop expects. Typed fields refuse a nested value at its first level; this
    bounds the JSON-valued ones (and what a `__post_init__` does with them)."""
    try:
        return decoder.decode(data)
    except RecursionError:
        raise msgspec.DecodeError("arrays or maps nested too deeply") from None


def error_text(e: msgspec.DecodeError) -> str:
    """A decode error as callers read it: the field as they named it (`$.a.b` -> `a.b`)."""
    return str(e).replace(" - at `$`", "").replace("`$.", "`")
