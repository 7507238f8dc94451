"""Issue 14's limits, slow readers and watchdog: each limit is a clear error naming it and its
flag, answered before any work, and the server serves the next request; a client that reads
a stream too slowly gets an error it can see, its blocks are freed and nobody else notices;
a worker step that never finishes (SIGSTOP) fails the calls in flight within
`watchdog_timeout` and the worker is restarted. A tiny model keeps it quick."""

from __future__ import annotations

import os
import signal
import socket
import time

import httpx
import msgspec
import pytest
import zmq

from radixserve.client import Client, ServerError
from radixserve.messages import MAX_INPUT_IDS, GenerateCall, RpcCall
from radixserve.server.runtime import Runtime
from tests.factories import tiny_model_dir
from tests.server.conftest import assert_idle_and_all_free, assert_server_idle
from tests.server.test_faults import alive, long_call, wait_dead

LIMITS = dict(max_frame_bytes=8192, max_request_bytes=4096, max_prompt_chars=200,
              max_stop_strings=2, max_stop_chars=10, max_top_logprobs_num=5,
              max_constraint_chars=100, max_grammar_compile_seconds=0.1,
              max_client_backlog=32, http_stream_backlog=32, rpc_send_buffer_bytes=8192)
"""`rpc_send_buffer_bytes`: else the kernel takes some 50,000 chunks before any backlog."""
SLOW_REGEX = "[ -~]{1,20000}x"
"""Tiny, but xgrammar takes ~0.8 s to compile it on an idle 2-core EPYC: 8x the limit,
where `[0-9]+` takes ~1 ms. (`[a-z]{1,3000}` took 0.22 s idle: too close to a limit.)"""
SMALL = {"max_new_tokens": 2}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")


@pytest.fixture(scope="module")
def limited(tiny):
    with Runtime(str(tiny), max_total_tokens=8192, **LIMITS) as rt:
        yield rt
        assert_server_idle(rt.rpc_address)


@pytest.fixture(scope="module")
def client(limited):
    with Client(limited.rpc_address, timeout=120) as c:
        yield c


def served(c: Client) -> None:
    assert c.generate(input_ids=[5, 6, 7], sampling_params=SMALL)["output_ids"]


def refused(c: Client, match: str, **kwargs) -> ServerError:
    with pytest.raises(ServerError) as err:
        c.generate(**kwargs)
    assert err.value.code == "invalid_request", err.value
    assert match in err.value.message, err.value
    served(c)
    return err.value


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt="x" * 201, sampling_params=SMALL), "max_prompt_chars=200 (--max-prompt-chars"),
    (dict(prompt=["hi", "y" * 201], sampling_params=SMALL), "prompt 1 of 201 characters"),
    (dict(input_ids=[5] * 2049, sampling_params=SMALL), "maximum context length of 2048"),
    (dict(prompt="hi", sampling_params={**SMALL, "stop": ["a", "b", "c"]}),
     "max_stop_strings=2 (--max-stop-strings)"),
    (dict(prompt="hi", sampling_params={**SMALL, "stop": ["a"], "stop_regex": ["b", "c"]}),
     "max_stop_strings=2"),
    (dict(prompt="hi", sampling_params={**SMALL, "stop": "x" * 11}),
     "max_stop_chars=10 (--max-stop-chars)"),
    (dict(prompt="hi", sampling_params={**SMALL, "stop_regex": "x" * 11}), "max_stop_chars=10"),
    (dict(prompt="hi", sampling_params=SMALL, return_logprob=True, top_logprobs_num=6),
     "max_top_logprobs_num, --max-top-logprobs-num"),
    (dict(prompt="hi", sampling_params={**SMALL, "regex": "a" * 101}),
     "sampling_params.regex of 101 characters exceeds max_constraint_chars=100 "
     "(--max-constraint-chars)"),
    (dict(prompt="hi", sampling_params={**SMALL, "n": 129}),
     "max_running_requests=128 (--max-running-requests)"),
])
def test_each_limit_is_an_error_naming_it_then_the_server_serves(client, kwargs, match):
    refused(client, match, **kwargs)


def test_a_constraint_that_compiles_too_long_is_refused(client):
    start = time.monotonic()
    err = refused(client, "did not compile within max_grammar_compile_seconds=0.1 "
                  "(--max-grammar-compile-seconds)", prompt="hi",
                  sampling_params={**SMALL, "regex": SLOW_REGEX})
    assert "regex" in err.message
    assert time.monotonic() - start < 30  # xgrammar's one-off set-up (~3 s) is not bounded
    start = time.monotonic()  # the same text again: refused at once, not compiled again
    refused(client, "max_grammar_compile_seconds", prompt="hi",
            sampling_params={**SMALL, "regex": SLOW_REGEX})
    assert time.monotonic() - start < 5
    out = client.generate("hi", sampling_params={**SMALL, "regex": "[0-9]+"})
    assert out["text"].isdigit(), out


def test_a_burst_of_slow_grammars_restarts_nothing_and_the_others_are_served(limited, client):
    """Issue 25, class 4: thirty constraints that each compile past the limit, at once,
    compile off the scheduler's loop: each fails by itself with the limit named, while
    plain requests are served, and no process is restarted."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.server.survival import assert_survived, baseline

    before = baseline(client)

    def slow(i: int) -> str:
        with Client(limited.rpc_address, timeout=120) as c:
            try:
                c.generate("hi", sampling_params={**SMALL, "regex": f"[ -~]{{1,{20000 + i}}}x"})
            except ServerError as e:
                return f"{e.code}: {e.message}"
            return "compiled"

    started = time.monotonic()
    with ThreadPoolExecutor(30) as pool:
        burst = [pool.submit(slow, i) for i in range(30)]
        served_while = 0
        while not all(f.done() for f in burst):
            served(client)  # the loop keeps scheduling while the compiles run
            served_while += 1
        messages = [f.result() for f in burst]
    assert time.monotonic() - started < 120
    assert served_while > 0
    # Its own compile ran past the limit, or it waited past it for a compile thread.
    assert all(m.startswith("invalid_request: ") and "max_grammar_compile_seconds=0.1" in m
               or m.startswith("overloaded: ") and "grammar_compile_threads" in m
               for m in messages), messages
    assert_survived(client, before)


def test_input_ids_are_bounded_while_decoding():
    decoder = msgspec.msgpack.Decoder(RpcCall)
    ok = msgspec.msgpack.encode(GenerateCall(call_id=1, input_ids=[[1, 2], [3]]))
    assert decoder.decode(ok).input_ids == [[1, 2], [3]]
    for ids in ([1] * (MAX_INPUT_IDS + 1), [[1] * (MAX_INPUT_IDS + 1)]):
        frame = msgspec.msgpack.encode({"type": "generate", "call_id": 1, "input_ids": ids})
        with pytest.raises(msgspec.ValidationError, match=f"length <= {MAX_INPUT_IDS}"):
            decoder.decode(frame)


def test_rpc_frame_limit(limited, client):
    big = [40000] * 4000  # 3 bytes each in msgpack: a frame of ~12 KB
    # A client told the limit refuses the call before sending it.
    with Client(limited.rpc_address, timeout=60, max_frame_bytes=8192) as careful:
        with pytest.raises(ServerError) as err:
            careful.generate(input_ids=big, sampling_params=SMALL)
        assert err.value.code == "frame_too_large", err.value
        assert "max_frame_bytes=8192" in err.value.message
        served(careful)
    # A client that does not: ZeroMQ drops the connection unread; the call fails at once.
    with Client(limited.rpc_address, timeout=60, max_frame_bytes=1 << 30) as careless:
        start = time.monotonic()
        with pytest.raises(ServerError) as err:
            careless.generate(input_ids=big, sampling_params=SMALL)
        assert err.value.code == "disconnected", err.value
        assert "max_frame_bytes" in err.value.message
        assert time.monotonic() - start < 10
        served(careless)  # it reconnects by itself
    # A raw socket gets no reply, and the server goes on serving everyone else.
    ctx = zmq.Context()
    try:
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(limited.rpc_address)
        raw.send(b"\x00" * 9000)
        assert not raw.poll(500)
        raw.close()
    finally:
        ctx.destroy(linger=0)
    served(client)
    assert_idle_and_all_free(client)


def test_http_limits(limited):
    with httpx.Client(base_url=limited.http_url, timeout=60) as http:
        big = b'{"text": "' + b"a" * 5000 + b'"}'
        r = http.post("/generate", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "request_too_large"
        assert "max_request_bytes=4096 (--max-request-bytes)" in r.json()["error"]["message"]

        def chunked():  # no Content-Length: counted as it comes in
            yield b'{"text": "'
            for _ in range(10):
                yield b"a" * 1000
            yield b'"}'

        r = http.post("/generate", content=chunked())
        assert r.status_code == 413 and "max_request_bytes" in r.text, r.text
        r = http.post("/generate", json={"text": "x" * 201, "sampling_params": SMALL})
        assert r.status_code == 400 and "max_prompt_chars=200" in r.text, r.text
        r = http.post("/generate", json={"text": "hi", "sampling_params": {
            **SMALL, "stop": ["a", "b", "c"]}})
        assert r.status_code == 400 and "max_stop_strings" in r.text, r.text
        model = http.get("/v1/models").json()["data"][0]["id"]
        r = http.post("/v1/chat/completions", json={"model": model, "max_tokens": 2, "messages": [
            {"role": "user", "content": "z" * 150}, {"role": "user", "content": "z" * 150}]})
        assert r.status_code == 400 and "max_prompt_chars=200" in r.text, r.text
        assert r.json()["error"]["param"] == "messages"
        r = http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2,
                                               "logprobs": 6})
        assert r.status_code == 400 and "--max-top-logprobs-num" in r.text, r.text
        r = http.post("/generate", json={"text": "hi", "sampling_params": SMALL})
        assert r.status_code == 200 and r.json()["output_ids"], r.text


def _wait_idle(c: Client, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        s = c.stats()
        if s["running"] == 0 and s["waiting"] == 0:
            return
        assert time.monotonic() < deadline, f"still busy: {s}"
        time.sleep(0.1)


LONG = {"max_new_tokens": 1500, "ignore_eos": True, "n": 8}


def test_slow_rpc_stream_reader_gets_an_error_and_its_blocks_back(limited, client):
    ctx = zmq.Context()
    try:
        slow = ctx.socket(zmq.DEALER)
        slow.setsockopt(zmq.LINGER, 0)
        slow.setsockopt(zmq.RCVHWM, 1)
        slow.setsockopt(zmq.RCVBUF, 4096)  # the kernel holds little for it either
        slow.connect(limited.rpc_address)
        call = GenerateCall(call_id=7, text=["a b c", "d e f", "g h i", "j k l"],
                            sampling_params=LONG, stream=True,
                            rid=[f"slow-{i}" for i in range(4)])
        slow.send(msgspec.msgpack.encode(call))
        deadline = time.monotonic() + 90
        while client.stats()["running"] == 0:  # it started...
            assert time.monotonic() < deadline
            time.sleep(0.05)
        _wait_idle(client, 90)  # ...and was ended long before its 1500 tokens
        served(client)  # everyone else is served meanwhile
        assert_idle_and_all_free(client)
        decoder = msgspec.msgpack.Decoder()
        last = None
        while slow.poll(2000):  # now it reads: what was queued, then the error
            last = decoder.decode(slow.recv())
            assert last["call_id"] == 7
            if last["type"] != "chunk":
                break
        assert last is not None and last["type"] == "error", last
        assert last["code"] == "slow_reader" and "max_client_backlog=32" in last["message"]
        slow.close()
    finally:
        ctx.destroy(linger=0)
    served(client)


def test_slow_http_stream_reader_gets_an_error_event(limited, client):
    host, port = limited.http_url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    try:
        body = msgspec.json.encode({"text": ["a b c", "d e f"], "sampling_params": LONG,
                                    "stream": True})
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 90
        while client.stats()["running"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        _wait_idle(client, 90)  # aborted, though nothing was read
        served(client)
        assert_idle_and_all_free(client)
        sock.settimeout(30)
        data = b""
        while b"data: [DONE]" not in data:
            part = sock.recv(1 << 20)
            assert part, data[-500:]
            data += part
        tail = data[-2000:]
        assert b"slow_reader" in tail and b"http-stream-backlog" in tail, tail
    finally:
        sock.close()
    served(client)


def test_watchdog_restarts_a_stopped_worker(tiny):
    with Runtime(str(tiny), max_total_tokens=4096, watchdog_timeout=3) as rt, \
            Client(rt.rpc_address, timeout=120) as c:
        served(c)
        pids = c.health()["pids"]
        t, outcome = long_call(c, 1900)
        try:
            while c.stats()["running"] == 0:
                time.sleep(0.02)
            stopped_at = time.monotonic()
            os.kill(pids["worker"], signal.SIGSTOP)
            t.join(60)
            assert "error" in outcome, outcome
            assert outcome["error"].code == "worker_hung", outcome["error"]
            assert "watchdog_timeout=3s (--watchdog-timeout)" in outcome["error"].message
            assert 2.5 < outcome["at"] - stopped_at < 15
            assert wait_dead([pids["worker"], pids["scheduler"]]), "the stopped worker lives"
            deadline = time.monotonic() + 120
            while c.health()["status"] != "ok":
                assert time.monotonic() < deadline, "never served again"
                time.sleep(0.2)
            served(c)
            new = c.health()["pids"]
            assert new["worker"] != pids["worker"]
            assert_idle_and_all_free(c)
        finally:
            if alive(pids["worker"]):
                os.kill(pids["worker"], signal.SIGKILL)


def test_limit_options_are_config_fields_and_flags():
    import argparse

    from radixserve.cli import add_options
    from radixserve.config import ServerConfig

    parser = argparse.ArgumentParser()
    add_options(parser, ServerConfig)
    args = vars(parser.parse_args([
        "--max-request-bytes", "2048", "--max-prompt-chars", "100", "--watchdog-timeout", "2.5",
        "--max-grammar-compile-seconds", "0.5", "--rpc-send-buffer-bytes", "65536"]))
    config = ServerConfig.from_kwargs(**args)
    assert (config.max_request_bytes, config.max_prompt_chars, config.watchdog_timeout,
            config.max_grammar_compile_seconds, config.rpc_send_buffer_bytes) == (
        2048, 100, 2.5, 0.5, 65536)
    assert ServerConfig().max_prompt_chars is None  # derived from the context length
    for bad in (dict(watchdog_timeout=0), dict(max_request_bytes=10), dict(max_stop_strings=0),
                dict(max_grammar_compile_seconds=-1), dict(max_client_backlog=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServerConfig.from_kwargs(**bad)


class _FullSocket:
    """A ROUTER whose queue to every client is full until `open` is set."""

    def __init__(self) -> None:
        self.open, self.sent = False, []

    def send_multipart(self, frames, flags=0):
        if not self.open:
            raise zmq.Again()
        self.sent.append(frames)


def _front_door(backlog: int):
    from types import SimpleNamespace

    from radixserve.rids import RidsInFlight
    from radixserve.front_door.control_calls import ControlCalls
    from radixserve.front_door.output import Call
    from radixserve.front_door.process import FrontDoor
    from radixserve.front_door.tokenizing import Tokenizing
    from radixserve.transport.replies import ClientReplies

    door = FrontDoor.__new__(FrontDoor)
    door.config = SimpleNamespace(max_client_backlog=backlog)
    door.encoder = msgspec.msgpack.Encoder()
    door.rpc, door.outbox = _FullSocket(), SimpleNamespace(sent=[])
    door.outbox.send = door.outbox.sent.append
    door.calls, door.control = {}, ControlCalls()
    door.rids = RidsInFlight()
    door.tokenizing = Tokenizing()
    door.replies = ClientReplies(door.rpc, backlog, door._on_gone, door._on_slow_reader)

    def add(peer: bytes, call_id: int, stream: bool) -> None:
        rid = f"{peer.decode()}-{call_id}"
        outputs = SimpleNamespace(states=[SimpleNamespace(rid=rid, finished=False)],
                                  requests=[SimpleNamespace(rid=rid)])
        door.calls[(peer, call_id)] = Call(peer, call_id, stream, outputs)
        door.rids.owners[rid] = (peer, call_id)

    return door, add


def test_front_door_backlog_ends_a_slow_clients_streams_only():
    from radixserve.messages import ChunkReply, Control, ResultReply

    door, add = _front_door(backlog=4)
    add(b"slow", 1, stream=True)
    add(b"slow", 2, stream=False)
    add(b"fast", 3, stream=True)
    assert door._reply(b"slow", ResultReply(2, {"done": True}))
    for i in range(4):
        assert door._reply(b"slow", ChunkReply(1, 0, "x", [i]))
    assert (b"slow", 1) not in door.calls, "the stream was ended"
    assert (b"slow", 2) in door.calls and (b"fast", 3) in door.calls
    aborts = [msgspec.msgpack.decode(f, type=Control).op for f in door.outbox.sent]
    assert [(type(a).__name__, a.rid) for a in aborts] == [("AbortCall", "slow-1")]
    door.rpc.open = True
    door.replies.flush()
    assert not door.replies.backlog
    replies = [msgspec.msgpack.decode(f[1]) for f in door.rpc.sent]
    assert [(r["type"], r["call_id"]) for r in replies] == [("result", 2), ("error", 1)]
    assert replies[1]["code"] == "slow_reader" and "max_client_backlog=4" in replies[1]["message"]


def test_front_door_drops_a_client_that_never_reads():
    from radixserve.messages import ResultReply

    door, add = _front_door(backlog=2)
    for i in range(6):
        add(b"deaf", i, stream=False)
    for i in range(5):
        door._reply(b"deaf", ResultReply(i, {}))
    assert not door.calls and not door.replies.backlog and not door.rids.owners  # taken for gone
