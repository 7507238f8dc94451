"""The HTTP thread's in-process hand-off to the front door (transport/in_process.py), without
a server: a thread plays the front door's loop, taking calls and answering them."""

from __future__ import annotations

import asyncio
import select
import threading
import time
from typing import Any

import pytest

from radixserve.client import ServerError
from radixserve.messages import ChunkReply, GenerateCall, HealthCall, ResultReply
from radixserve.transport.in_process import InProcessCalls, LocalClient


def test_a_call_queued_after_the_drain_wakes_the_loop_again() -> None:
    door = InProcessCalls()
    door.submit("a")
    assert select.select([door.fd], [], [], 0)[0]
    assert door.take() == ["a"]
    assert not select.select([door.fd], [], [], 0)[0] and door.take() == []
    door.submit("b")
    assert select.select([door.fd], [], [], 0)[0] and door.take() == ["b"]


class FakeFrontDoor:
    """Takes each call as the front door's loop would and answers it with `answer(call)`."""

    def __init__(self, door: InProcessCalls, answer: Any) -> None:
        self.door, self.answer, self.calls = door, answer, []
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop:
            if select.select([self.door.fd], [], [], 0.05)[0]:
                for call in self.door.take():
                    self.calls.append(call)
                    for reply in self.answer(call):
                        self.door.deliver(reply)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_calls_arrive_typed_and_replies_come_back_as_objects() -> None:
    door = InProcessCalls()
    front = FakeFrontDoor(door, lambda call: [ResultReply(call.call_id, {"status": "ok"})])
    client = LocalClient(door, max_frame_bytes=1 << 20, stream_backlog=None)
    try:
        assert run(client.health()) == {"status": "ok"}
        assert run(client.abort("r1", api_key="k")) == {"status": "ok"}
    finally:
        front.stop = True
    assert isinstance(front.calls[0], HealthCall) and front.calls[0].api_key == door.key
    assert front.calls[1].api_key == "k"  # the caller's key speaks for the call, not the door's


def test_a_call_no_frame_could_carry_is_refused_before_the_front_door() -> None:
    door = InProcessCalls()
    front = FakeFrontDoor(door, lambda call: [])
    client = LocalClient(door, max_frame_bytes=1 << 20, stream_backlog=None)
    try:
        with pytest.raises(ServerError) as bad:  # decoded as the socket would: field named
            run(client.generate(input_ids=[0], sampling_params={"max_new_tokens": "x"}))
        assert bad.value.code == "invalid_request" and "max_new_tokens" in str(bad.value)
        with pytest.raises(ServerError) as big:
            run(client.generate(input_ids=[0] * (1 << 20)))
        assert big.value.code == "frame_too_large"
    finally:
        front.stop = True
    assert front.calls == []


def test_a_lagging_stream_ends_slow_reader_and_is_aborted() -> None:
    def answer(call: Any) -> list[Any]:
        if isinstance(call, GenerateCall):
            return [ChunkReply(call.call_id, 0, "x", [1]) for _ in range(5)]
        return []

    door = InProcessCalls()
    front = FakeFrontDoor(door, answer)
    client = LocalClient(door, max_frame_bytes=1 << 20, stream_backlog=2)
    client.typed = True

    async def lag() -> None:
        stream = client.generate_stream(input_ids=[0], rid="s1")
        await stream.__anext__()  # sends the call; the other chunks pile up meanwhile
        await asyncio.sleep(0.5)
        with pytest.raises(ServerError) as slow:
            async for _ in stream:
                pass
        assert slow.value.code == "slow_reader"

    try:
        run(lag())
        deadline = time.monotonic() + 5
        while len(front.calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        front.stop = True
    assert [type(c).__name__ for c in front.calls] == ["GenerateCall", "AbortCall"]
    assert front.calls[1].rid == "s1"
