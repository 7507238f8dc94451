"""vLLM's KV-event sockets, on the front door (`--kv-events`): what llm-d's indexer, Dynamo
and Ray's KV-aware router subscribe to on a vLLM replica, with the same frames.

- A PUB socket: each batch of events (messages/kv_events.py) is three frames: the topic,
  the batch's sequence number (8 bytes, big-endian, from 0) and the msgpack
  `KVEventBatch`. A batch is what one scheduler step changed.
- A ROUTER socket for replays: a request is one frame, the first sequence number wanted
  (8 bytes, big-endian; a REQ socket adds the empty delimiter). The answer is each kept
  batch from there on as (topic, seq, payload), then (empty, -1, empty). A request from 0,
  or from before the oldest batch kept, is answered with the whole tree instead (the
  scheduler's `BlockEventLog.dump`: `AllBlocksCleared`, then a `BlockStored` per edge,
  parents first), under the sequence number of the last batch it covers, so that a
  subscriber goes on from the live stream. Requests that come while a dump is being made
  share it: one dump per round trip to the scheduler, however many ask.

Access is the cache-events socket's (transport/cache_events.py): with tenants, only an
operator key subscribes or asks for a replay (ZeroMQ PLAIN), since the events carry every
tenant's token ids; a single-user server needs no key, as vLLM's subscribers expect.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import msgspec
import zmq

from radixserve.messages import CacheEvents
from radixserve.messages.kv_events import KVEvent, KVEventBatch
from radixserve.messages.rpc import ResultReply, RpcReply
from radixserve.tenants import Tenants
from radixserve.transport.cache_events import EventsPublisher
from radixserve.transport.sockets import bind_tcp

log = logging.getLogger(__name__)

KV_EVENTS_KEPT = 10_000
"""Batches kept for replay (vLLM's `buffer_steps`)."""
DUMP_EVENTS_PER_MESSAGE = 1024
"""A whole-tree dump is sent as batches of this many events."""
END = (-1).to_bytes(8, "big", signed=True)


class KVEventsPublisher:
    """The two sockets and the batches kept for replay. Plain: the front door's loop polls
    `replay` and calls `serve_replay`; a dump's answer comes back through `put` (it is
    the reply sink of the front door's snapshot call to the scheduler)."""

    def __init__(self, tenants: Tenants, host: str, port: int, replay_port: int,
                 topic: str) -> None:
        self.out = EventsPublisher(tenants, host, port)  # its authentication, its context
        self.out.sock.setsockopt(zmq.SNDHWM, KV_EVENTS_KEPT)
        self.replay = self.out.ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.setsockopt(zmq.MAXMSGSIZE, 64)  # a request is 8 bytes
        self.replay.setsockopt(zmq.SNDHWM, 2 * KV_EVENTS_KEPT + 2)  # a whole answer fits
        if self.out.auth is not None:
            self.replay.plain_server = True
        self.replay_address = bind_tcp(self.replay, host, replay_port)
        self.address = self.out.address
        self.topic = topic.encode()
        self.seq = -1
        """The last batch's sequence number (-1: none yet)."""
        self.kept: deque[tuple[int, bytes]] = deque(maxlen=KV_EVENTS_KEPT)
        self.dump_waiting: list[bytes] = []
        """Replay clients waiting for the dump in flight (empty: none in flight)."""
        self.encoder = msgspec.msgpack.Encoder()

    def publish(self, events: CacheEvents) -> None:
        """Send `events.blocks` as the next batch (nothing when there are none)."""
        if events.blocks:
            self.seq += 1
            payload = self.encoder.encode(KVEventBatch(time.time(), events.blocks))
            self.out.sock.send_multipart((self.topic, self.seq.to_bytes(8, "big"), payload))
            self.kept.append((self.seq, payload))

    def serve_replay(self) -> bool:
        """Answer one replay request from the batches kept; True when it needs the whole
        tree and no dump is in flight yet (the caller asks the scheduler for one, answered
        through `put`). A malformed request is dropped unanswered."""
        frames = self.replay.recv_multipart()
        if len(frames) != 3 or frames[1] or len(frames[2]) != 8:
            log.warning("kv events: a malformed replay request (%d frames) dropped",
                        len(frames))
            return False
        client, start = frames[0], int.from_bytes(frames[2], "big")
        kept = start > 0 and bool(self.kept) and self.kept[0][0] <= start
        if kept or start > self.seq:  # (nothing published yet: nothing to dump either)
            for seq, payload in self.kept:
                if seq >= start:
                    self._send(client, seq, payload)
            self._end(client)
            return False
        self.dump_waiting.append(client)
        return len(self.dump_waiting) == 1

    def put(self, reply: RpcReply) -> bool:
        """The scheduler's snapshot (`CacheSnapshotCall(blocks=True)`): the dump, sent to
        every client waiting for it. It covers every batch published so far, since the
        scheduler sent those before it answered."""
        waiting, self.dump_waiting = self.dump_waiting, []
        blocks: list[KVEvent] = []
        if isinstance(reply, ResultReply) and isinstance(reply.result, dict) and self.seq >= 0:
            blocks = msgspec.convert(reply.result.get("blocks", []), list[KVEvent])
        for start in range(0, len(blocks), DUMP_EVENTS_PER_MESSAGE):
            payload = self.encoder.encode(KVEventBatch(
                time.time(), blocks[start:start + DUMP_EVENTS_PER_MESSAGE]))
            for client in waiting:
                self._send(client, self.seq, payload)
        for client in waiting:
            self._end(client)
        return True

    def _send(self, client: bytes, seq: int, payload: bytes) -> None:
        self.replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))

    def _end(self, client: bytes) -> None:
        self.replay.send_multipart((client, b"", b"", END, b""))

    def close(self) -> None:
        self.out.close()
