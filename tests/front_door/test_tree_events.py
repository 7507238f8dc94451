"""The front door's cache events: re-encoded and sent only while someone subscribes (off is
free), to every subscriber while any does, and not after the last one leaves."""

from __future__ import annotations

import msgspec
import zmq

from radixserve.config import ServerConfig
from radixserve.front_door.tree_events import TreeEventsOut
from radixserve.messages import CacheEvents
from radixserve.tenants import Tenants


def _settle(events: TreeEventsOut) -> None:
    """What the front door's loop does when the socket turns readable."""
    assert events.subscriptions.sock.poll(5000)
    events.take_subscriptions()


def _subscriber(ctx: zmq.Context, address: str) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(address)
    return sub


def _until_received(events: TreeEventsOut, sub: zmq.Socket) -> None:
    """Publish until `sub` gets an event (a subscriber joins some time after it connects)."""
    for seq in range(100, 200):
        events.publish(CacheEvents(epoch="e", seq=seq, page_size=16))
        if sub.poll(100):
            return
    raise AssertionError("the subscriber got nothing")


def test_events_go_out_only_while_someone_subscribes() -> None:
    config = ServerConfig()
    events = TreeEventsOut(config, Tenants.from_config(config))
    ctx = zmq.Context()
    try:
        assert not events.wanted  # nobody yet: a step's events are not re-encoded
        first = _subscriber(ctx, events.addresses["cache_events_address"])
        _settle(events)
        assert events.wanted
        second = _subscriber(ctx, events.addresses["cache_events_address"])
        events.publish(CacheEvents(epoch="e", seq=7, page_size=16))
        assert first.poll(5000)
        got = msgspec.msgpack.decode(first.recv(), type=CacheEvents)
        assert (got.epoch, got.seq) == ("e", 7)
        first.close()
        _until_received(events, second)  # one left: still published
        assert events.wanted
        second.close()
        _settle(events)
        assert not events.wanted
    finally:
        ctx.destroy(linger=0)
        events.close()


def test_with_kv_events_every_step_is_published() -> None:
    """vLLM's events are kept for replay whether or not anyone subscribes."""
    config = ServerConfig(kv_events="radixserve", kv_events_port=0, kv_events_replay_port=0)
    events = TreeEventsOut(config, Tenants.from_config(config))
    try:
        assert events.wanted
    finally:
        events.close()
