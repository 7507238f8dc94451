"""The HTTP thread's in-process hand-off to the front door (transport/in_process.py), without
a server: a thread plays the front door's loop, taking calls and answering their sinks."""

from __future__ import annotations

import asyncio
import select
import threading
from typing import Any

import pytest

from radixserve.client import ServerError
from radixserve.messages import ChunkReply, GenerateCall, HealthCall, ResultReply
from radixserve.results.generate import GenerateResult
from radixserve.transport.in_process import InProcessCalls, LocalClient


class Sink:
    def put(self, reply: Any) -> bool:
        return True


def test_a_call_queued_after_the_drain_wakes_the_loop_again() -> None:
    door, sink = InProcessCalls(), Sink()
    door.submit("a", sink)
    assert select.select([door.fd], [], [], 0)[0]
    assert door.take() == [("a", sink)]
    assert not select.select([door.fd], [], [], 0)[0] and door.take() == []
    door.submit("b", sink)
    assert select.select([door.fd], [], [], 0)[0] and door.take() == [("b", sink)]


class FakeFrontDoor:
    """Takes each call as the front door's loop would and answers it with `answer(call)`,
    noting what each sink's `put` said."""

    def __init__(self, door: InProcessCalls, answer: Any) -> None:
        self.door, self.answer, self.calls, self.taken = door, answer, [], []
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop:
            if select.select([self.door.fd], [], [], 0.05)[0]:
                for call, sink in self.door.take():
                    self.calls.append(call)
                    for reply in self.answer(call):
                        self.taken.append(sink.put(reply))


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_other_calls_arrive_typed_and_replies_come_back_as_objects() -> None:
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


def test_a_generate_call_reaches_the_front_door_as_it_was_built() -> None:
    result = GenerateResult([], True)
    door = InProcessCalls()
    front = FakeFrontDoor(door, lambda call: [ResultReply(call.call_id, result)])
    client = LocalClient(door, max_frame_bytes=1 << 20, stream_backlog=None)
    call = GenerateCall(call_id=0, input_ids=[0], api_key="k")
    try:
        assert run(client.generate_call(call)) is result
    finally:
        front.stop = True
    assert front.calls == [call] and front.calls[0] is call  # no frame: the object itself


def test_a_lagging_stream_ends_slow_reader_and_its_sink_takes_no_more() -> None:
    def answer(call: Any) -> list[Any]:
        return [ChunkReply(call.call_id, 0, "x", [1]) for _ in range(5)]

    door = InProcessCalls()
    front = FakeFrontDoor(door, answer)
    client = LocalClient(door, max_frame_bytes=1 << 20, stream_backlog=2)

    async def lag() -> None:
        stream = client.stream_call(GenerateCall(call_id=0, input_ids=[0], stream=True))
        await stream.__anext__()  # sends the call; the other chunks pile up meanwhile
        await asyncio.sleep(0.5)
        with pytest.raises(ServerError) as slow:
            async for _ in stream:
                pass
        assert slow.value.code == "slow_reader"
        assert "http-stream-backlog" in slow.value.message

    try:
        run(lag())
    finally:
        front.stop = True
    # The front door is told the sink takes no more: it aborts the call's requests.
    assert front.taken[-1] is False and front.taken[:2] == [True, True]
