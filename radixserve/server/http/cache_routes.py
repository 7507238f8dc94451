"""The cache's own routes: pin and unpin a prefix, the tree summarised as JSON (`/cache`)
and drawn as a page (`/cache/view`). Each is one RPC call made with the HTTP caller's own
API key, so the front door puts pins in the caller's namespace and shows a caller only its
own tenant's prefixes."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request
from msgspec import Meta, Struct
from starlette.responses import HTMLResponse, Response

from radixserve.messages import MAX_PIN_TTL
from radixserve.server.http.cache_view import render_cache_page
from radixserve.server.http.errors import ApiError, decode_body, json_response
from radixserve.server.http.openapi import request_body
from radixserve.server.http.state import state_of

router = APIRouter()
MAX_TOP = 1000


class PinBody(Struct, forbid_unknown_fields=True, kw_only=True):
    """A prefix to keep in memory: exactly one of `text` and `input_ids`; `ttl` seconds
    (none: until unpinned); `cache_salt` as in /generate."""

    text: str | None = None
    input_ids: list[Annotated[int, Meta(ge=0)]] | None = None
    ttl: Annotated[float, Meta(gt=0, le=MAX_PIN_TTL)] | None = None
    cache_salt: str | None = None


class UnpinBody(Struct, forbid_unknown_fields=True, kw_only=True):
    """The prefix a pin was made with (and its `cache_salt`), or `all: true` alone: every
    pin the caller may see."""

    text: str | None = None
    input_ids: list[Annotated[int, Meta(ge=0)]] | None = None
    cache_salt: str | None = None
    all: bool = False


def _one_prompt(body: PinBody | UnpinBody) -> None:
    if (body.text is None) == (body.input_ids is None):
        raise ApiError(400, "pass exactly one of text or input_ids", param="text")


def _check_top(top: int) -> None:
    if not 0 <= top <= MAX_TOP:
        raise ApiError(400, f"top must be in [0, {MAX_TOP}], got {top}", param="top")


@router.post("/cache/pin", openapi_extra=request_body(PinBody))
async def pin(request: Request) -> Response:
    """Pin a prefix (prefilled first if not cached): `{"tokens", "expires_in", "tier",
    "pinned_tokens"}`; 400 past `--max-pinned-tokens`."""
    body = await decode_body(request, PinBody)
    _one_prompt(body)
    _, key = state_of(request).caller(request)
    return json_response(await state_of(request).rpc.pin_prefix(
        body.text, body.input_ids, ttl=body.ttl, cache_salt=body.cache_salt, api_key=key))


@router.post("/cache/unpin", openapi_extra=request_body(UnpinBody))
async def unpin(request: Request) -> Response:
    """Drop the pin of exactly this prefix, or with `all` every pin the caller may see:
    `{"unpinned": bool, "pins", "tokens", "pinned_tokens"}`."""
    body = await decode_body(request, UnpinBody)
    _, key = state_of(request).caller(request)
    rpc = state_of(request).rpc
    if body.all:
        if body.text is not None or body.input_ids is not None or body.cache_salt is not None:
            raise ApiError(400, "pass all alone, or a prefix (text or input_ids)", param="all")
        return json_response(await rpc.unpin_all(api_key=key))
    _one_prompt(body)
    return json_response(await rpc.unpin_prefix(body.text, body.input_ids,
                                                cache_salt=body.cache_salt, api_key=key))


@router.get("/cache")
async def cache_info(request: Request, top: int = 20) -> Response:
    """The tree summarised: the `top` largest and hottest prefixes (with their ancestors)
    with the first words of their text, pins, totals per tier (docs/http.md)."""
    _check_top(top)
    _, key = state_of(request).caller(request)
    return json_response(await state_of(request).rpc.cache_info(top, api_key=key))


@router.get("/cache/view", response_class=HTMLResponse)
async def cache_view(request: Request, top: int = 50) -> Response:
    """The tree drawn for a person: one self-contained HTML page."""
    _check_top(top)
    _, key = state_of(request).caller(request)
    info = await state_of(request).rpc.cache_info(top, api_key=key)
    return HTMLResponse(render_cache_page(info))
