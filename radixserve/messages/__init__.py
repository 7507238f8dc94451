"""The wire schema: every message that crosses a process boundary, as msgspec Structs.

Only msgspec, the standard library and the result structs (`radixserve.results`, which
import nothing else of radixserve) are imported here. Decoders are typed, so a frame
that does not fit its type is rejected with an error naming the field; nothing is pickled,
and no field is untyped (free-form values are `JsonValue`, bounded in depth).

- `fields`: bounded lists and JSON values the others share;
- `sampling`: a request's sampling settings and beam search;
- `rpc`: clients <-> front door (and a router <-> its replicas): calls and replies;
- `control`: a control operation's envelope to the scheduler, and its answer;
- `scheduler`: front door <-> scheduler: tokenized requests, updates, cache events;
- `worker`: scheduler <-> worker: a step's batch and result.
"""

from radixserve.messages.control import (CacheScope, Caller, Control, ControlOp,
                                         ControlReply)
from radixserve.messages.fields import (MAX_BATCH, MAX_INPUT_IDS, Batch, InputIds,
                                        JsonObject, JsonValue, TokenIds)
from radixserve.messages.rpc import (MAX_BARE_CALL_BYTES, MAX_ENVELOPE_BYTES, MAX_PIN_TTL,
                                     OPERATOR_CALLS,
                                     AbortCall, CacheInfoCall, CacheSnapshotCall, ChunkReply,
                                     Envelope, ErrorReply, FlushCacheCall,
                                     GenerateArgs, GenerateCall, HealthCall, LoadLoraCall,
                                     LorasCall, ModelInfoCall, PinCall, ProfileCall,
                                     ResultReply, RpcCall, RpcReply,
                                     StatsCall, UnloadLoraCall, UnpinCall, WorkersCall, decode,
                                     error_text)
from radixserve.messages.sampling import (CONSTRAINT_FIELDS, BeamParams, SamplingParams,
                                          SamplingParamsArg, beam_arguments)
from radixserve.messages.scheduler import (CacheEvents, ReplicaLoad, RequestRejected,
                                           RequestUpdate, SchedulerInput, SchedulerOutput,
                                           SchedulerReady, TokenizedRequest, UpdateBatch)
from radixserve.messages.worker import (PLACEHOLDER, DecodePath, ForwardBatch, ForwardResult,
                                        KVTransfer, LoadLoraRequest, LogitBias, LoraFill,
                                        LoraInfo, ReleaseViewsRequest, RowSampling,
                                        SamplingEdit, SeqLogprobs, SeqOutput, SeqSampling,
                                        StepResult, StepSampling, TableEdit, TopLogprobs,
                                        UnloadLoraRequest, WorkerCall, WorkerFailed, WorkerInfo,
                                        WorkerInput, WorkerOutput, WorkerReady)

__all__ = [
    "CacheScope", "Caller", "Control", "ControlOp", "ControlReply", "MAX_BATCH", "MAX_INPUT_IDS",
    "Batch", "InputIds", "JsonObject", "JsonValue", "TokenIds", "MAX_BARE_CALL_BYTES",
    "MAX_ENVELOPE_BYTES", "MAX_PIN_TTL", "OPERATOR_CALLS", "AbortCall", "CacheInfoCall",
    "CacheSnapshotCall", "ChunkReply", "Envelope", "ErrorReply",
    "FlushCacheCall", "GenerateArgs", "GenerateCall", "HealthCall", "LoadLoraCall", "LorasCall",
    "ModelInfoCall", "PinCall", "ProfileCall", "ResultReply", "RpcCall", "RpcReply", "StatsCall",
    "UnloadLoraCall", "UnpinCall", "WorkersCall", "decode", "error_text", "CONSTRAINT_FIELDS",
    "BeamParams", "SamplingParams", "SamplingParamsArg", "beam_arguments", "CacheEvents",
    "ReplicaLoad", "RequestRejected", "RequestUpdate", "SchedulerInput", "SchedulerOutput",
    "SchedulerReady", "TokenizedRequest", "UpdateBatch", "PLACEHOLDER", "DecodePath",
    "ForwardBatch", "ForwardResult", "KVTransfer", "LoadLoraRequest", "LogitBias", "LoraFill",
    "LoraInfo", "ReleaseViewsRequest", "RowSampling", "SamplingEdit", "SeqLogprobs", "SeqOutput",
    "SeqSampling", "StepResult", "StepSampling", "TableEdit", "TopLogprobs", "UnloadLoraRequest",
    "WorkerCall", "WorkerFailed", "WorkerInfo", "WorkerInput", "WorkerOutput", "WorkerReady",
]
