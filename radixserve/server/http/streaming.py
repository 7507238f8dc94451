"""Server-sent events, and noticing clients that go away.

A client that disconnects must not keep its request running: its KV blocks would stay
taken until the request ends by itself. Two cases:
- while an answer is being computed (a plain request, or a stream before its first
  event): `AppState.generate` races the work against the connection and aborts;
- mid-stream: Starlette stops iterating the body when a send fails or a disconnect
  arrives, but it does not close the generator, which might then linger until garbage
  collection. `EventStream` closes it at once, and the generators here abort their rids
  in `finally` when they did not finish.
Every abort is made with the caller's own key: rids are scoped by tenant, so the same rid
of another tenant is never reached.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

import anyio
import msgspec
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from radixserve.messages import ChunkReply
from radixserve.results.generate import GenerateResult

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


def sse(payload: Any) -> bytes:
    return b"data: " + _encode(payload) + b"\n\n"


class EventStream(StreamingResponse):
    """`text/event-stream` whose event generator is always closed when the response ends."""

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except OSError:
            pass  # the client went away mid-write; the generator's cleanup aborts its work
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def stream_ended(state: Any, api_key: str | None, rids: list[str],
                       stream: AsyncIterator[Any], finished: bool) -> None:
    """A stream's event generator ends: if it did not finish (client gone, or cancelled),
    close the stream and abort its rids as the caller (`api_key`), shielded from the
    cancellation that may be under way."""
    if finished:
        return
    with anyio.CancelScope(shield=True):
        await stream.aclose()  # type: ignore[attr-defined]
        await state.abort(rids, api_key)


Streamed = ChunkReply | GenerateResult
"""An item of a generate stream as the routes read it: chunks, then the result."""
