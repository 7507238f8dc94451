"""`RadixIngress`: the deployment Ray's HTTP proxy calls. It reads each request's prompt
(keys.py `RouteKey`), hands the request to a radixserve replica through the deployment
handle, whose request router (router.py) picks the replica by its radix tree, and streams
the replica's answer back unchanged (status, headers, body; SSE as it is made).

Light: no model weights, only the tokenizer (for the page hashes) and the API keys (a
call's tenant names its cache namespace). Authentication stays the replicas'."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from radixserve.config import ServerConfig
from radixserve.model.loader import load_tokenizer, resolve_model
from radixserve.ray.feed import describe
from radixserve.ray.keys import (GENERATE_PATHS, REPLICA_HEADER, RouteKey, bearer,
                                 fleet_secret, route_key)
from radixserve.tenants import Tenants


class RadixIngress:
    def __init__(self, server: Any, model: str, options: dict[str, Any],
                 cache_secret: str | None) -> None:
        """`server`: the handle of the RadixServer deployment; `model`, `options`: the
        replicas' (for their tokenizer and keys); `cache_secret`: theirs (None: their
        `cache_secret_file`)."""
        self.server = server
        config = ServerConfig.from_kwargs(model=model, **options)
        self.tenants = Tenants.from_config(config)
        self.tokenizer = load_tokenizer(resolve_model(model))
        self.secret = fleet_secret(cache_secret, options.get("cache_secret_file"))

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        path = request.url.path
        headers = {k.lower(): v for k, v in request.headers.items()}
        if path == "/ray/router" and request.method == "GET":
            if not self.tenants.is_operator(bearer(headers)):  # it names every replica
                return JSONResponse({"error": "the operator key only"}, status_code=403)
            return JSONResponse(describe())
        key = RouteKey()
        if request.method == "POST" and path in GENERATE_PATHS:
            try:
                parsed = msgspec.json.decode(body)
            except msgspec.DecodeError:
                parsed = None  # the replica answers the 400
            key = await asyncio.to_thread(route_key, path, parsed, headers, self.tokenizer,
                                          self.tenants, self.secret)
        if headers.get(REPLICA_HEADER):
            key = dataclasses.replace(key, replica=headers[REPLICA_HEADER])
        answer = self.server.options(stream=True).forward.remote(
            key, request.method, path, request.url.query, headers, body)
        first = await answer.__anext__()
        if len(first) == 3:  # answered whole by the replica itself (/ray/replica)
            return Response(first[2], status_code=first[0], headers=first[1])
        status, out_headers = first
        media_type = out_headers.pop("content-type", None)
        return StreamingResponse(_rest(answer), status_code=status, headers=out_headers,
                                 media_type=media_type)


async def _rest(answer: Any) -> AsyncIterator[bytes]:
    async for chunk in answer:
        yield chunk
