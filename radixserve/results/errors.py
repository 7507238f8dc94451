"""Every way a call can fail, as one enum of codes with one table of HTTP statuses.

A code travels as its string (`ErrorCode` is a str enum: the wire spelling is the value),
in an RPC `ErrorReply`, in a `ServerError` a client raises, and in an HTTP error body
(native and OpenAI shapes alike), whose status comes from `HTTP_STATUS`."""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple


class ErrorCode(StrEnum):
    """Why a call was refused or failed. Servers, routers and the client library send only
    these (tests/server/test_surface.py scans the sources for any other)."""

    INVALID_REQUEST = "invalid_request"
    """The call's arguments are wrong; the message names the field."""
    MALFORMED_FRAME = "malformed_frame"
    """The frame is not msgpack (or nests too deeply, or has several parts)."""
    FRAME_TOO_LARGE = "frame_too_large"
    """The client refused to send a call larger than the server's `max_frame_bytes`."""
    UNAUTHORIZED = "unauthorized"
    """No valid API key on a server that has keys."""
    FORBIDDEN = "forbidden"
    """A tenant's key on an operator's call."""
    OVERLOADED = "overloaded"
    """Past a queue limit: try again later."""
    NOT_READY = "not_ready"
    """The server is starting or restarting its worker."""
    WORKER_DIED = "worker_died"
    WORKER_HUNG = "worker_hung"
    REPLICA_DIED = "replica_died"
    """Through a router: the replica serving the call went away."""
    REPLICA_REMOVED = "replica_removed"
    NO_REPLICA = "no_replica"
    SLOW_READER = "slow_reader"
    """A stream was ended because its client read it too slowly."""
    DISCONNECTED = "disconnected"
    """The client's connection dropped with the call in flight."""
    INTERNAL = "internal"
    """A bug: the message gives a reference into the server's log."""


class HttpStatus(NamedTuple):
    status: int
    openai_type: str
    """OpenAI's `error.type` for it."""


HTTP_STATUS: dict[ErrorCode, HttpStatus] = {
    ErrorCode.INVALID_REQUEST: HttpStatus(400, "invalid_request_error"),
    ErrorCode.MALFORMED_FRAME: HttpStatus(400, "invalid_request_error"),
    ErrorCode.FRAME_TOO_LARGE: HttpStatus(413, "invalid_request_error"),
    ErrorCode.UNAUTHORIZED: HttpStatus(401, "invalid_request_error"),
    ErrorCode.FORBIDDEN: HttpStatus(403, "permission_error"),
    ErrorCode.OVERLOADED: HttpStatus(503, "server_overloaded"),
    ErrorCode.NOT_READY: HttpStatus(503, "server_not_ready"),
    ErrorCode.WORKER_DIED: HttpStatus(503, "server_error"),
    ErrorCode.WORKER_HUNG: HttpStatus(503, "server_error"),
    ErrorCode.REPLICA_DIED: HttpStatus(503, "server_error"),
    ErrorCode.REPLICA_REMOVED: HttpStatus(503, "server_error"),
    ErrorCode.NO_REPLICA: HttpStatus(503, "server_error"),
    ErrorCode.SLOW_READER: HttpStatus(408, "invalid_request_error"),
    ErrorCode.DISCONNECTED: HttpStatus(503, "server_error"),
    ErrorCode.INTERNAL: HttpStatus(500, "server_error"),
}
"""Each code's HTTP status: the only place it is decided (a code missing here fails at
import, below)."""

assert set(HTTP_STATUS) == set(ErrorCode), set(ErrorCode) - set(HTTP_STATUS)


class ServerError(RuntimeError):
    """The server refused or failed a call; `code` says how (see `ErrorCode`)."""

    def __init__(self, code: ErrorCode | str, message: str) -> None:
        code = ErrorCode(code)
        super().__init__(f"[{code}] {message}")
        self.code, self.message = code, message

    @property
    def http(self) -> HttpStatus:
        return HTTP_STATUS[self.code]
