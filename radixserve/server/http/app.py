"""The HTTP app: SGLang's native API, the OpenAI-compatible API and /metrics, over one
client into the front door (in-process) or a router (RPC).

The app is a thin translator. Validation, tokenization of prompts, per-request state,
detokenization, stop strings, streaming and aborts all stay in the front door; the app
only turns HTTP into the front door's calls and their replies into HTTP, so the two APIs
cannot drift."""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from radixserve.chat.errors import ChatError
from radixserve.results.errors import ServerError
from radixserve.config import ServerConfig
from radixserve.server.http import (cache_routes, lora_routes, messages_api, native, openai_api,
                                    openapi, responses_api)
from radixserve.server.http import messages_protocol as mp
from radixserve.server.http import responses_protocol as rp
from radixserve.server.http import openai_protocol as proto
from radixserve.server.http.errors import HANDLERS, ApiError
from radixserve.server.http.foreign_fields import default_only
from radixserve.server.http.state import TENANT_SCOPE, AppState, Connect, state_of
from radixserve.tenants import Tenants
from radixserve.transport.replies import internal_error

OPEN_PATHS = frozenset({"/health", "/ready"})
"""Reachable without the API key, so that load balancers can probe."""


def create_app(config: ServerConfig, model_dir: Path, connect: Connect) -> FastAPI:
    """`connect` makes the app's client into the front door (`AppState`)."""
    state = AppState(config, model_dir, connect)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        yield
        await state.stop()

    app = FastAPI(title="radixserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.radix = state
    app.include_router(native.router, responses=openapi.ERRORS)
    app.include_router(cache_routes.router, responses=openapi.ERRORS)
    app.include_router(lora_routes.router, responses=openapi.ERRORS)
    app.include_router(openai_api.router, responses=openapi.ERRORS)
    app.include_router(responses_api.router, responses=openapi.ERRORS)
    app.include_router(messages_api.router, responses=openapi.ERRORS)
    openapi.install(app, [native.GenerateBody, native.AbortBody, native.ProfileBody,
                          cache_routes.PinBody, cache_routes.UnpinBody,
                          lora_routes.LoadLoraBody, lora_routes.UnloadLoraBody,
                          proto.CompletionRequest, proto.ChatRequest, rp.ResponsesRequest,
                          mp.MessagesRequest, mp.CountTokensRequest],
                    sorted(state.model_names),
                    {body.__name__: default_only(body) for body in (
                        native.GenerateBody, proto.CompletionRequest, proto.ChatRequest)},
                    state.serves_lora)

    @app.get("/metrics", response_class=PlainTextResponse, responses=openapi.ERRORS)
    async def metrics(request: Request) -> Response:
        """The per-tenant series (tenant names, what each uses) and the pool-wide pinned
        total are the operator's; any other caller gets the server's totals."""
        _, key = state.caller(request)
        try:
            stats = await state.rpc.stats(api_key=key)
        except ServerError:  # starting or restarting: counters still count
            stats = None
        return Response(state.metrics.render(stats, operator=state.tenants.is_operator(key)),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    for kind, handler in HANDLERS.items():
        app.add_exception_handler(kind, _counted(handler))
    app.add_exception_handler(ChatError, _counted(_chat_error))
    app.add_exception_handler(HTTPException, _counted(_http_exception))
    app.add_exception_handler(RequestValidationError, _counted(_invalid_parameter))
    app.add_exception_handler(Exception, _counted(_unexpected))
    app.add_exception_handler(ClientDisconnect, _client_gone)
    app.add_middleware(RequestGate, tenants=state.tenants, max_bytes=config.max_request_bytes)
    return app


def _counted(handler: Any) -> Any:
    async def handle(request: Request, exc: Exception) -> Response:
        response = await handler(request, exc)
        state = state_of(request)
        route = request.scope.get("route")  # the route's template: bounded label values
        endpoint = getattr(route, "path", None) or "unmatched"
        state.metrics.errors.labels(endpoint, str(response.status_code)).inc()
        return response
    return handle


async def _chat_error(request: Request, exc: Exception) -> Response:
    """A chat request the chat layer refused (`radixserve.chat`), answered as its status,
    type, param and code say."""
    assert isinstance(exc, ChatError)
    return ApiError(exc.status, exc.message, type=exc.type, param=exc.param,
                    code=exc.code).response()


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Routing errors (404 unknown path, 405 wrong method) in the same error shape."""
    assert isinstance(exc, HTTPException)
    return ApiError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}"
                    ).response()


async def _invalid_parameter(request: Request, exc: Exception) -> Response:
    """A query or path parameter FastAPI could not parse (`/flush_cache?timeout=x`): a 400 in
    the same error shape as a bad body, not FastAPI's own 422 `{"detail": [...]}`."""
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    where = [str(part) for part in first.get("loc", ())]
    param = where[-1] if where else None
    return ApiError(400, f"invalid {' '.join(where[:1]) or 'request'} parameter {param}: "
                    f"{first.get('msg', 'invalid value')}", param=param).response()


async def _client_gone(request: Request, exc: Exception) -> Response:
    """The connection closed while the body came in (the client left, or the server closed
    it for room or time: server/http/connections.py): nobody to answer, nothing to log."""
    return Response(status_code=400)


async def _unexpected(request: Request, exc: Exception) -> Response:
    message = internal_error(f"HTTP {request.method} {request.url.path}")
    return ApiError(500, message, type="server_error", code="internal").response()


class BodyTooLarge(ApiError):
    def __init__(self, limit: int, size: int | None) -> None:
        said = f"of {size} bytes " if size is not None else ""
        super().__init__(413, f"the request body {said}exceeds max_request_bytes={limit} "
                         "(--max-request-bytes)", code="request_too_large")


class RequestGate:
    """What every HTTP request passes before a route sees it, in this order: a plain ASGI
    middleware, the outermost (it must not buffer bodies or streamed responses).

    1. The key: with API keys, every route but /health needs `Authorization: Bearer <key>`
       (or, as Anthropic's clients send it, `x-api-key: <key>`) with a configured key,
       checked before a byte of the body is read (a refused request's connection closes
       unread); without, a key is optional (the operator's, `--admin-api-key`). The key's
       tenant and the key go in the scope (`AppState.caller`): the routes pass the key on
       with their calls, and the front door derives the tenant, and whether it is the
       operator, again.
    2. The body's size, `max_request_bytes`: a body that says (Content-Length) it is
       larger is refused before a byte of it is read; one that does not say (chunked) is
       counted as it comes in and refused once past the limit, so no more than the limit
       is ever buffered."""

    def __init__(self, app: ASGIApp, tenants: Tenants, max_bytes: int) -> None:
        self.app, self.tenants, self.max_bytes = app, tenants, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if scope["path"] not in OPEN_PATHS:
            scheme, _, key = headers.get(b"authorization", b"").partition(b" ")
            bearer = scheme.lower() == b"bearer" and bool(key)
            if not bearer and headers.get(b"x-api-key"):  # Anthropic's clients send this
                key, bearer = headers[b"x-api-key"], True
            tenant = None
            if bearer:
                try:
                    tenant = self.tenants.tenant_of(key.decode())
                except UnicodeDecodeError:
                    tenant = None
            if tenant is not None:
                scope[TENANT_SCOPE] = (tenant, key.decode())
            elif bearer or self.tenants.enabled:  # else anonymous, as a keyless server allows
                return await closing(ApiError(
                    401, "invalid or missing API key: send 'Authorization: Bearer <api key>' "
                    "(or 'x-api-key: <api key>')", code="invalid_api_key"))(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None:
            try:
                size = int(length)
            except ValueError:
                size = None
            if size is None or size < 0:
                return await ApiError(400, "invalid Content-Length header").response()(
                    scope, receive, send)
            if size > self.max_bytes:
                return await closing(BodyTooLarge(self.max_bytes, size))(scope, receive, send)
        seen = 0

        async def counted() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes, None)  # answered by its handler
            return message

        await self.app(scope, counted, send)


def closing(error: ApiError) -> Response:
    """`error`'s response for a request whose body is not read: the connection closes
    after it, so no byte more of that body is read (else the server would read it all, to
    find the next request after it)."""
    response = error.response()
    response.headers["connection"] = "close"
    return response
