"""HTTP errors in one shape for every route: OpenAI's `{"error": {"message", "type", "param",
"code"}}`, which also carries SGLang's native `{"error": {"message"}}`.

Handlers raise `ApiError`; RPC failures (`ServerError`, whose code gives the status:
`results.errors.HTTP_STATUS`) and bad JSON bodies are translated here, so each route reads
as its happy path and every failure names what went wrong."""

from __future__ import annotations

import functools
import re
from http import HTTPStatus
from typing import Any, TypeVar

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from radixserve.messages import decode, error_text
from radixserve.results.errors import ErrorCode, ServerError
from radixserve.server.http.foreign_fields import default_only

T = TypeVar("T", bound=msgspec.Struct)

class ApiError(Exception):
    """An HTTP error response; `param` names the offending request field when known.
    `code` is always a string, as in an RPC error: an `ErrorCode`, one of HTTP's own
    (`invalid_api_key`, `model_not_found`, `request_too_large`), or by default the status's
    (`invalid_request` for a 400, else its name: `not_found`, `method_not_allowed`)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.code = code or (ErrorCode.INVALID_REQUEST.value if status == 400 else
                             HTTPStatus(status).phrase.lower().replace(" ", "_"))

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> Response:
        return json_response(self.body(), self.status)

    @classmethod
    def from_server(cls, e: ServerError, param: str | None = None) -> ApiError:
        """The RPC failure `e` as HTTP: its status and type from `results.errors`."""
        status, kind = e.http
        return cls(status, e.message, type=kind, param=param, code=e.code)


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready (its requests were aborted)."""


def json_response(content: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(content), status, media_type="application/json")


MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects in a request body. Typed fields refuse a nested
value at its first level; this bounds the free-form ones (JSON schemas, tool parameters,
template variables), which are walked recursively after decoding (a JSON schema check
recurses several frames per level). An honest body nests a few levels (OpenAI allows 10
in a structured output's schema)."""

_ESCAPE = re.compile(rb"\\.", re.S)


def json_depth(raw: bytes) -> int:
    """How deep `raw` (JSON) nests arrays and objects: brackets outside strings, counted
    without parsing, in numpy passes over the body (at most `max_request_bytes`; it runs on
    the event loop, where a regex over a body of many strings took seconds). For invalid
    JSON it is meaningless; the decoder then says why."""
    data = np.frombuffer(_ESCAPE.sub(b"", raw), np.uint8)
    quotes = np.flatnonzero(data == ord('"'))
    opening = (data == ord("[")) | (data == ord("{"))
    brackets = np.flatnonzero(opening | (data == ord("]")) | (data == ord("}")))
    # a bracket is outside every string when an even number of quotes come before it
    brackets = brackets[np.searchsorted(quotes, brackets) % 2 == 0]
    steps = np.where(opening[brackets], 1, -1)
    return int(np.cumsum(steps).max(initial=0))


@functools.cache
def _decoder(kind: type[T]) -> msgspec.json.Decoder:
    return msgspec.json.Decoder(kind)


async def decode_body(request: Request, kind: type[T]) -> T:
    """The JSON body as `kind` (a msgspec Struct): 400 naming the field on any mismatch,
    when it nests deeper than `MAX_JSON_DEPTH` (checked first), or when it sets a field
    radixserve accepts at its default only (`foreign_fields.DefaultOnly`) to another value."""
    raw = await request.body()
    # A body of few brackets cannot nest deeply: two counts, and no walk.
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:
        depth = json_depth(raw)
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"the request body nests arrays and objects {depth} deep, "
                           f"more than {MAX_JSON_DEPTH}")
    try:
        body = decode(_decoder(kind), raw)
    except msgspec.ValidationError as e:
        raise ApiError(400, f"invalid request: {error_text(e)}", param=_param(str(e))) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    for name, (default, why) in default_only(kind).items():
        if getattr(body, name) != default:
            raise ApiError(400, f"{name} is not supported: {why}", param=name)
    return body


def _param(message: str) -> str | None:
    """The offending field of a msgspec error: `... - at `$.messages[0].role`` ->
    `messages[0].role`; `Object missing required field `model`` -> `model`."""
    where = message.rsplit("- at `$.", 1)[1].rstrip("`") if "- at `$." in message else None
    named = message.split("field `", 1)[1].split("`", 1)[0] if "field `" in message else None
    if where and named:
        return f"{where}.{named}"
    return where or named


async def on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def on_server_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ServerError)
    return ApiError.from_server(exc).response()


async def on_client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


HANDLERS = {ApiError: on_api_error, ServerError: on_server_error, ClientGone: on_client_gone}
