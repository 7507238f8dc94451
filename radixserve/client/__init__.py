"""RPC clients of a radixserve server (or router): `Client` (threads) and `AsyncClient`
(asyncio), the same operations (`radixserve.api`) over a sync and an async transport.

Both speak the msgpack schema of `radixserve.messages` (GenerateCall ... / ResultReply,
ChunkReply, ErrorReply) over one zmq DEALER socket, and match replies to calls by
`call_id`, so many calls can be in flight at once on one client.

`api_key`: the caller's key (its tenant token) on a server started with `--api-key`; sent
with every call. `generate(..., cache_salt=...)` narrows the cache namespace further.
"""

from radixserve.client.aio import AsyncClient, Stream
from radixserve.client.frames import DEFAULT_MAX_FRAME_BYTES
from radixserve.client.replies import ServerError
from radixserve.client.threaded import Client

__all__ = ["AsyncClient", "Client", "DEFAULT_MAX_FRAME_BYTES", "ServerError",
           "Stream"]
