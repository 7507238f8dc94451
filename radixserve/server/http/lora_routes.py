"""LoRA adapters over HTTP: SGLang's `/load_lora_adapter` and `/unload_lora_adapter` (also
under vLLM's `/v1/` names; the operator's), the list (`/lora_adapters`), and what an
OpenAI request's `model` means: the base model by one of its names, else a loaded
adapter (its requests run under it), else a 404 naming both. Each is one RPC call made
with the HTTP caller's own key, so the front door decides who is the operator (and who
sees the adapters' paths)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Request
from msgspec import Meta, Struct
from starlette.responses import Response

from radixserve.messages.rpc import LoraName
from radixserve.server.http.errors import ApiError, decode_body, json_response
from radixserve.server.http.openapi import request_body
from radixserve.server.http.state import AppState, state_of

router = APIRouter()


class LoadLoraBody(Struct, forbid_unknown_fields=True):
    """SGLang's and vLLM's body: the name requests will say (`lora_name`, or SGLang's
    `lora_path` of /generate; an OpenAI `model`) and the adapter's directory on the server's
    machine."""

    lora_name: LoraName
    lora_path: Annotated[str, Meta(max_length=4096)]
    pinned: bool = False
    """SGLang's: keep the adapter in GPU memory for good. Not supported: false only."""


class UnloadLoraBody(Struct, forbid_unknown_fields=True):
    lora_name: LoraName


@router.post("/load_lora_adapter", openapi_extra=request_body(LoadLoraBody))
@router.post("/v1/load_lora_adapter", openapi_extra=request_body(LoadLoraBody))
async def load_lora_adapter(request: Request) -> Response:
    """Load the PEFT LoRA adapter at `lora_path` as `lora_name`: `{"success": true, "name",
    "path", "fingerprint", "rank", "target_modules", "unloaded"}` (`unloaded`: adapters
    unloaded to make room, past `--max-loaded-loras`). A 400 names what is wrong with the
    adapter. The operator's call."""
    body = await decode_body(request, LoadLoraBody)
    if body.pinned:
        raise ApiError(400, "pinned is not supported: adapters are unloaded least recently "
                       "used first past --max-loaded-loras", param="pinned")
    state = state_of(request)
    answer = await state.rpc.load_lora_adapter(body.lora_name, body.lora_path,
                                               api_key=state.caller(request)[1])
    return json_response({"success": True, **answer})


@router.post("/unload_lora_adapter", openapi_extra=request_body(UnloadLoraBody))
@router.post("/v1/unload_lora_adapter", openapi_extra=request_body(UnloadLoraBody))
async def unload_lora_adapter(request: Request) -> Response:
    """Unload `lora_name` (a 400 while a request uses it): `{"success": true, "unloaded"}`.
    The operator's call."""
    body = await decode_body(request, UnloadLoraBody)
    state = state_of(request)
    await state.rpc.unload_lora_adapter(body.lora_name, api_key=state.caller(request)[1])
    return json_response({"success": True, "unloaded": body.lora_name})


@router.get("/lora_adapters")
async def lora_adapters(request: Request) -> Response:
    """The adapters loaded, least recently used first: `{"loras": [{"name", "path",
    "fingerprint", "rank", "target_modules"}]}` (`path` null but to the operator)."""
    state = state_of(request)
    return json_response({"loras": await adapters(state, request)})


async def adapters(state: AppState, request: Request) -> list[dict[str, Any]]:
    """The adapters loaded now, as the caller may see them ([] when LoRA serving is off;
    through a router, those every replica has)."""
    return await state.rpc.list_lora_adapters(api_key=state.caller(request)[1])


async def resolve_model(state: AppState, request: Request, model: str,
                        lora_path: str | None = None) -> str | None:
    """The adapter an OpenAI request runs under: None for the base model (`model` one of
    its names), else the loaded adapter `model` names; a 404 `model_not_found` naming what
    is served otherwise. `lora_path`, SGLang's extension, names the adapter itself (which
    must then be loaded; the server checks) and `model` the base model or that adapter."""
    if model in state.model_names or model == lora_path:
        return lora_path
    loaded = [a["name"] for a in await adapters(state, request)]
    if model in loaded and lora_path is None:
        return model
    if model in loaded:
        raise ApiError(400, f"model names the LoRA adapter {model!r} and lora_path "
                       f"{lora_path!r}: name one adapter", param="lora_path")
    raise unknown_model(state, model, loaded)


def unknown_model(state: AppState, model: str, loaded: list[str],
                  param: str = "model") -> ApiError:
    """A 404 naming `model`, as the request's field `param` gave it."""
    also = f" and the LoRA adapters {', '.join(map(repr, loaded))}" if loaded else ""
    return ApiError(404, f"The model '{model[:200]}' does not exist; this server serves "
                    f"'{state.served_name}'{also}", param=param, code="model_not_found")
