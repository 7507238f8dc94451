"""SGLang's native HTTP API: /generate (plain or streamed as server-sent events), model and
server info, cache flush, worker profiling, abort, health. Shaped like SGLang's so that its
frontend (`RuntimeEndpoint`) and benchmark client work unchanged; all real work is one RPC
call. A route that changes state takes POST only (GET is 405): a page on another site can
make a browser send a GET (an image, a link) to a keyless server on localhost."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import time
from typing import Annotated, Any, AsyncIterator

from fastapi import APIRouter, Request
from msgspec import Struct
from starlette.responses import PlainTextResponse, Response

from radixserve.messages import (ChunkReply, GenerateArgs, GenerateCall, JsonValue,
                                 SamplingParams)
from radixserve.messages.rpc import LoraNames
from radixserve.results.errors import ServerError
from radixserve.results.generate import GenerateResult
from radixserve.results.generate import sglang_output, sglang_result
from radixserve.rids import NamingError, answer_names, name_prompts
from radixserve.front_door import admin
from radixserve.server.http.errors import ApiError, decode_body, json_response
from radixserve.server.http import lora_routes
from radixserve.server.http.foreign_fields import DefaultOnly
from radixserve.server.http.metrics import StreamTimer
from radixserve.server.http.openapi import STREAMED, request_body
from radixserve.server.http.state import AppState, state_of
from radixserve.server.http.streaming import (DONE, EventStream, Streamed, sse,
                                              stream_ended)

router = APIRouter()
HEALTH_TIMEOUT = 30.0



class GenerateBody(GenerateArgs, kw_only=True, forbid_unknown_fields=True):
    """SGLang's /generate body: the generate call's fields (`GenerateArgs`, declared once
    for the RPC call and this body) and HTTP's own; SGLang's fields radixserve lacks are
    accepted at SGLang's defaults only (`foreign_fields`, checked by `decode_body`): its
    clients and router send them so."""

    lora_path: LoraNames | None = None
    """SGLang's name for `lora_name` (its frontend and router send the adapter's name
    here); a body gives one or the other, and errors name the one it gave."""
    model: str | None = None
    """SGLang's router sends it (null unless it routes by model): the base model by one of
    its names, or a loaded LoRA adapter, as an OpenAI request's `model`."""
    log_metrics: bool = True
    no_logs: bool = False
    """SGLang's: do not log this request. radixserve logs no request's contents anyway."""
    image_data: Annotated[JsonValue, DefaultOnly("radixserve generates from text only")] = None
    audio_data: Annotated[JsonValue, DefaultOnly("radixserve generates from text only")] = None
    video_data: Annotated[JsonValue, DefaultOnly("radixserve generates from text only")] = None
    input_embeds: Annotated[JsonValue, DefaultOnly("prompts are text or token ids")] = None
    session_params: Annotated[JsonValue, DefaultOnly("radixserve has no sessions; its "
                                                      "radix cache keeps every prefix")] = None
    custom_logit_processor: Annotated[JsonValue, DefaultOnly(
        "radixserve runs no caller's code")] = None
    token_ids_logprob: Annotated[JsonValue, DefaultOnly(
        "logprobs are the chosen and the top tokens'")] = None
    return_hidden_states: Annotated[bool, DefaultOnly("hidden states stay on the worker")] = False
    return_routed_experts: Annotated[bool, DefaultOnly("no mixture-of-experts model here")] = False
    return_bytes: Annotated[bool, DefaultOnly("logprob tokens are text")] = False
    return_entropy: Annotated[bool, DefaultOnly("no per-token entropy is computed")] = False
    background: Annotated[bool, DefaultOnly("requests run while their caller waits")] = False


class AbortBody(Struct, forbid_unknown_fields=True):
    rid: str = ""
    abort_all: bool = False
    tenant: str | None = None
    """The operator's: abort this tenant's requests (with `abort_all`: all of them)."""


class ProfileBody(Struct, forbid_unknown_fields=True):
    """Of SGLang's profile options, the one that applies: where the trace goes (a name
    inside the server's profile directory)."""

    output_dir: str | None = None


@router.post("/generate", openapi_extra=request_body(GenerateBody), responses=STREAMED)
@router.put("/generate", openapi_extra=request_body(GenerateBody), responses=STREAMED)
async def generate(request: Request) -> Response:
    state = state_of(request)
    body = await decode_body(request, GenerateBody)
    try:
        named = name_prompts(body.text, body.input_ids, body.rid, "http")
    except NamingError as e:
        raise ApiError(400, str(e), param=e.field) from None
    if body.lora_path is not None and body.lora_name is not None:
        raise ApiError(400, "pass lora_name or lora_path (SGLang's name for it), not both",
                       param="lora_path")
    lora_field = "lora_name" if body.lora_path is None else "lora_path"
    lora = getattr(body, lora_field)
    if body.model is not None and (
            by_model := await lora_routes.resolve_model(state, request, body.model)):
        if lora is not None:
            raise ApiError(400, f"model names the LoRA adapter {by_model!r}: pass the "
                           f"adapter there or in {lora_field}, not both", param="model")
        lora, lora_field = by_model, "model"
    caller = state.caller(request)
    # The call's fields as decoded from the body (typed and bounded), its prompts named.
    args = {name: getattr(body, name) for name in GenerateArgs.__struct_fields__}
    args.update(rid=named.rid_arg, lora_name=lora)
    call = GenerateCall(call_id=0, api_key=caller[1], **args)
    try:
        result, stream = await state.generate(request, call, named.rids)
    except ServerError as e:
        raise _named(e, lora_field) from None
    if stream is None:
        assert isinstance(result, GenerateResult)  # a plain call's answer
        state.metrics.finished("generate", result.outputs, tenant=caller[0])
        return json_response(sglang_result(result))
    outputs, multi = answer_names(named.rids, body.sampling_params, not named.single)
    return EventStream(_events(state, stream, result, named.rids, outputs, multi, caller,
                               lora_field))


def _named(e: ServerError, lora_field: str) -> ApiError:
    """The server's error as HTTP, naming the adapter's field as the body did (the server
    knows it as `lora_name`)."""
    return ApiError.from_server(ServerError(e.code, e.message.replace("lora_name", lora_field)))


async def _events(state: AppState, stream: AsyncIterator[Streamed], first: Streamed,
                  rids: list[str], outputs: list[str], multi: bool,
                  caller: tuple[str, str | None], lora_field: str) -> AsyncIterator[bytes]:
    """SGLang's stream: per chunk, the output's cumulative text and ids with meta_info; then
    each output's complete result (full meta_info, logprobs); then [DONE]."""
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    timer = StreamTimer(state.metrics)
    finished = False
    try:
        chunk = first
        while isinstance(chunk, ChunkReply):
            i = chunk.index
            texts[i] = texts.get(i, "") + chunk.text
            ids.setdefault(i, []).extend(chunk.token_ids)
            timer.chunk(i, len(chunk.token_ids), time.perf_counter())
            event: dict[str, Any] = {"text": texts[i], "output_ids": ids[i], "meta_info": {
                "id": outputs[i] if i < len(outputs) else None, "finish_reason": None,
                "completion_tokens": len(ids[i])}}
            if multi:
                event["index"] = i
            yield sse(event)
            chunk = await stream.__anext__()
        state.metrics.finished("generate", chunk.outputs, itl_observed=True, tenant=caller[0])
        finished = True
        shared: dict[int, Any] = {}  # a prompt's logprobs, converted once for its outputs
        for i, out in enumerate(chunk.outputs):
            result = sglang_output(out, shared)
            yield sse({**result, "index": i} if multi else result)
    except ServerError as e:  # the server ended the call (e.g. the worker died)
        finished = True
        yield sse(_named(e, lora_field).body())
    finally:
        await stream_ended(state, caller[1], rids, stream, finished)
    yield DONE


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info(request: Request) -> Response:
    state = state_of(request)
    info = await state.model_info()
    return json_response({**info, "tokenizer_path": str(state.model_dir),
                          "served_model_name": state.served_name})


@router.get("/get_server_info")
@router.get("/server_info")
async def server_info(request: Request) -> Response:
    """The operator gets every option but the keys; a tenant the limits its requests are
    checked against (`admin.TENANT_CONFIG`) and the stats it may see."""
    state = state_of(request)
    _, key = state.caller(request)
    config = {k: v for k, v in dataclasses.asdict(state.config).items()
              if k not in ("api_key", "api_keys_file", "admin_api_key")}
    if not state.tenants.is_operator(key):
        config = {k: config[k] for k in admin.TENANT_CONFIG if k in config}
    stats = await state.rpc.stats(api_key=key)
    return json_response({**config, "model_path": str(state.model_dir),
                          "served_model_name": state.served_name,
                          "model_info": await state.model_info(), "internal_states": [stats],
                          "version": _version()})


def _version() -> str:
    try:
        return importlib.metadata.version("radixserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@router.post("/flush_cache", response_class=PlainTextResponse)
async def flush_cache(request: Request, timeout: float = 0.0) -> Response:
    """Drop the radix cache. Refused while requests run; with `timeout` (seconds), waits up
    to that long for them to finish, as SGLang's benchmark asks."""
    if timeout < 0:
        raise ApiError(400, f"timeout must be >= 0, got {timeout}", param="timeout")
    state = state_of(request)
    _, key = state.caller(request)
    deadline = time.monotonic() + timeout
    while not (await state.rpc.flush_cache(api_key=key))["flushed"]:
        if time.monotonic() >= deadline:
            raise ApiError(400, "cache not flushed: requests are still running or waiting "
                           "(pass ?timeout=SECONDS to wait for them)")
        await asyncio.sleep(0.05)
    return PlainTextResponse("Cache flushed.\n")


@router.post("/start_profile", openapi_extra=request_body(ProfileBody, required=False))
async def start_profile(request: Request) -> Response:
    """Start a torch.profiler trace of the worker's steps (optional JSON body:
    `{"output_dir": NAME}`, a subdirectory of the server's `--profile-dir`); the reply
    names the folder. The operator's call."""
    body = await decode_body(request, ProfileBody) if await request.body() else ProfileBody()
    state = state_of(request)
    return json_response(await state.rpc.start_profile(body.output_dir,
                                                       api_key=state.caller(request)[1]))


@router.post("/stop_profile")
async def stop_profile(request: Request) -> Response:
    """Stop the trace and write it (Chrome trace JSON); the reply names the file, `trace`."""
    state = state_of(request)
    return json_response(await state.rpc.stop_profile(api_key=state.caller(request)[1]))


@router.post("/abort_request", openapi_extra=request_body(AbortBody))
async def abort_request(request: Request) -> Response:
    """Abort `rid`, or with `abort_all` every request in flight (over HTTP or RPC): the
    caller's tenant's only (rids are scoped by tenant; without API keys there is one
    tenant); the operator's reach every tenant's, or with `tenant` that tenant's. The
    answer is `{"aborted": rid}`, or `{"aborted": count}` with `abort_all` (a rid that is
    not running is no error: it may have just finished)."""
    state = state_of(request)
    body = await decode_body(request, AbortBody)
    if not body.abort_all and not body.rid:
        raise ApiError(400, "pass rid, or abort_all: true", param="rid")
    if body.tenant is not None and not body.abort_all:
        raise ApiError(400, "tenant goes with abort_all: true", param="tenant")
    key = state.caller(request)[1]
    if body.abort_all:
        return json_response(await state.rpc.abort_all(tenant=body.tenant, api_key=key))
    await state.abort([body.rid], key)
    return json_response({"aborted": [body.rid]})


@router.post("/add_worker")
async def add_worker(request: Request, url: str) -> Response:
    """A router's: start routing to the replica at `url` (its RPC address), as SGLang's
    router names it. A server answers 400. The operator's call."""
    state = state_of(request)
    return json_response(await state.rpc.workers("add", url, api_key=state.caller(request)[1]))


@router.post("/remove_worker")
async def remove_worker(request: Request, url: str) -> Response:
    """A router's: stop routing to `url`; its calls in flight fail `replica_removed`."""
    state = state_of(request)
    return json_response(await state.rpc.workers("remove", url,
                                                 api_key=state.caller(request)[1]))


@router.get("/list_workers")
async def list_workers(request: Request) -> Response:
    """A router's replicas: state, load, calls in flight, pages its view holds."""
    state = state_of(request)
    return json_response(await state.rpc.workers("list", api_key=state.caller(request)[1]))


@router.get("/get_load")
async def get_load(request: Request) -> Response:
    """SGLang's load report, which its router's `power_of_two` policy polls: one entry (one
    data-parallel rank) with the sequences running and waiting (`num_reqs`), the waiting
    ones, and the KV tokens requests hold (`num_tokens`: cached pages no request holds are
    not load)."""
    state = state_of(request)
    s = await state.rpc.stats(api_key=state.caller(request)[1])
    held = s["num_blocks"] - s["free_blocks"] - s["evictable_blocks"]
    return json_response([{"dp_rank": 0, "num_reqs": s["running"] + s["waiting"],
                           "num_waiting_reqs": s["waiting"],
                           "num_tokens": held * s["page_size"]}])


@router.get("/health")
@router.get("/ready")
async def health(request: Request) -> Response:
    """200 once the model is loaded and warm and the worker answers; 503 while starting,
    while a dead worker or scheduler is restarted, and once the server gave up on them.
    Liveness and readiness are one here (`/ready` for probes and pickers that ask that
    route): a server whose children died serves nothing until they are back. Open even
    when --api-key is set."""
    status = (await state_of(request).rpc.health())["status"]
    return json_response({"status": status}, 200 if status == "ok" else 503)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """Like /health, and also runs a one-token generation through the whole pipeline."""
    state = state_of(request)
    if (await state.rpc.health())["status"] != "ok":
        return json_response({"status": "not ready"}, 503)
    probe = GenerateCall(call_id=0, input_ids=[0], sampling_params=SamplingParams(
        max_new_tokens=1, temperature=0.0), api_key=state.caller(request)[1])
    try:
        await asyncio.wait_for(state.rpc.generate_call(probe), HEALTH_TIMEOUT)
    except (ServerError, TimeoutError) as e:
        return json_response({"status": f"generation failed: {e}"}, 503)
    return json_response({"status": "ok"})
