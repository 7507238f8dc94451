"""What a caller gets from a reply: its result, a stream's chunk, or a `ServerError`.

The one place where a reply (radixserve.messages `ResultReply`, `ChunkReply`,
`ErrorReply`) becomes what `Client` and `AsyncClient` return, so both clients answer
alike and a change of the result's shape is made here once."""

from __future__ import annotations

from typing import Any

from radixserve.messages import ChunkReply, ErrorReply, RpcReply
from radixserve.results.errors import ErrorCode, ServerError
from radixserve.results.generate import GenerateResult
from radixserve.results.generate import sglang_result

DISCONNECTED = ("the connection to the server dropped, and calls in flight on it get no "
                "answer (the server drops a connection whose frame exceeds its "
                "max_frame_bytes, or it restarted)")


def result(reply: RpcReply, typed: bool = False) -> Any:
    """The answer a call's last reply carries; an `ErrorReply` raised as `ServerError`. A
    generate call's result in SGLang's dict shape (`results.generate.sglang_result`, the
    documented contract) unless `typed` (the HTTP server's client, whose routes read the
    structs); a control call's answer as it came."""
    if isinstance(reply, ErrorReply):
        raise ServerError(reply.code, reply.message)
    if isinstance(reply, ChunkReply):  # a server never answers a plain call with a chunk
        raise ServerError(ErrorCode.INTERNAL, f"a stream's chunk answered call {reply.call_id}")
    value = reply.result
    if not isinstance(value, GenerateResult):
        return value
    value = value.unpacked()  # the prompt logprobs, carried once, shown by each output
    return value if typed else sglang_result(value)


def stream_item(reply: RpcReply, typed: bool = False) -> Any:
    """A stream's reply as the caller sees it: a chunk `{"index", "text", "token_ids"}`
    (text since the output's previous chunk), then `{"final": result}`; with `typed`, the
    `ChunkReply` and then the result as they came."""
    if isinstance(reply, ChunkReply):
        return reply if typed else {"index": reply.index, "text": reply.text,
                                    "token_ids": reply.token_ids}
    value = result(reply, typed)
    return value if typed else {"final": value}


def ends_stream(reply: RpcReply) -> bool:
    """Whether `reply` is a stream's last: its result, or an error."""
    return not isinstance(reply, ChunkReply)
