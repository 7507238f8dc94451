"""What a caller gets from a reply: its result, a stream's chunk, or a `ServerError`.

The one place where a reply (radixserve.messages `ResultReply`, `ChunkReply`,
`ErrorReply`) becomes what `Client` and `AsyncClient` return, so both clients answer
alike and a change of the result's shape is made here once."""

from __future__ import annotations

from typing import Any

from radixserve.messages import ChunkReply, ErrorReply, RpcReply

DISCONNECTED = ("the connection to the server dropped, and calls in flight on it get no "
                "answer (the server drops a connection whose frame exceeds its "
                "max_frame_bytes, or it restarted)")


class ServerError(RuntimeError):
    """The server refused or failed a call; `code` says how (e.g. invalid_request,
    overloaded, worker_died, worker_hung, slow_reader, malformed_frame, frame_too_large,
    disconnected; through a router also replica_died, replica_removed, no_replica)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"[{code}] {message}")
        self.code, self.message = code, message


def result(reply: RpcReply) -> Any:
    """The answer a call's last reply carries; an `ErrorReply` raised as `ServerError`."""
    if isinstance(reply, ErrorReply):
        raise ServerError(reply.code, reply.message)
    if isinstance(reply, ChunkReply):  # a server never answers a plain call with a chunk
        raise ServerError("internal", f"a stream's chunk answered call {reply.call_id}")
    return reply.result


def stream_item(reply: RpcReply) -> dict[str, Any]:
    """A stream's reply as the caller sees it: a chunk `{"index", "text", "token_ids"}`
    (text since the output's previous chunk), then `{"final": result}`."""
    if isinstance(reply, ChunkReply):
        return {"index": reply.index, "text": reply.text, "token_ids": reply.token_ids}
    return {"final": result(reply)}


def ends_stream(reply: RpcReply) -> bool:
    """Whether `reply` is a stream's last: its result, or an error."""
    return not isinstance(reply, ChunkReply)
