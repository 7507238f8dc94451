"""A server's cache events, as a cache-aware router reads them: a SUB socket on
`model_info()["cache_events_address"]` sees a prompt's page hashes stored after it ran,
the snapshot call returns them, a flush arrives as `cleared`, an idle server sends one
heartbeat a second. (That the socket outlives a worker crash, the restarted scheduler's
events coming in a new epoch, is checked in test_faults, which crashes one anyway.)
A tiny model."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import pytest
import zmq

from radixserve.cache.events import page_hashes
from radixserve.client import Client, ServerError
from radixserve.messages import CacheEvents, ReplicaLoad
from radixserve.server.runtime import Runtime
from radixserve.tenants import ensure_secret_file, load_cache_secret
from tests.factories import tiny_model_dir
from tests.server.conftest import assert_server_idle

PAGE = 4
PROMPT = [300 + 7 * i for i in range(30)]  # 7 whole pages and 2 tokens
GREEDY = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory):
    """The server's cache secret, which keys its page hashes: a router is given it."""
    return str(ensure_secret_file(tmp_path_factory.mktemp("secret")))


@pytest.fixture(scope="module")
def runtime(tmp_path_factory, secret_file):
    tiny = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")
    with Runtime(str(tiny), max_total_tokens=2048, page_size=PAGE, debug_invariants=True,
                 cache_secret_file=secret_file) as rt:
        yield rt
        assert_server_idle(rt.rpc_address)


@pytest.fixture(scope="module")
def client(runtime):
    with Client(runtime.rpc_address, timeout=120) as c:
        yield c


class Subscriber:
    """A SUB socket on the server's events, and the set of hashes they add up to."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(address)
        self.decoder = msgspec.msgpack.Decoder(CacheEvents)
        self.events: list[CacheEvents] = []
        self.hashes: set[int] = set()

    def until(self, done: Callable[[CacheEvents], bool], timeout: float = 10.0) -> CacheEvents:
        """Read events (applying each) until one satisfies `done`; return it."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000) + 1):
                break
            events = self.decoder.decode(self.sock.recv())
            self.events.append(events)
            if events.cleared:
                self.hashes.clear()
            self.hashes.difference_update(events.removed)
            self.hashes.update(events.stored)
            if done(events):
                return events
        raise AssertionError(f"no such event in {timeout}s; got {self.events[-5:]}")

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture
def sub(client):
    s = Subscriber(client.model_info()["cache_events_address"])
    s.until(lambda e: True)  # connected: the idle heartbeat (at most a second) came through
    yield s
    s.close()


def test_a_prompt_is_published_and_in_the_snapshot_and_a_flush_clears(client, sub,
                                                                       secret_file):
    want = set(page_hashes(PROMPT, PAGE, key=load_cache_secret(secret_file)))
    assert not want & set(page_hashes(PROMPT, PAGE))  # not what anyone could compute
    client.generate(input_ids=PROMPT, sampling_params=GREEDY)
    sub.until(lambda e: want <= sub.hashes)
    last = sub.until(lambda e: e.load == ReplicaLoad())  # idle again
    snap = client.cache_snapshot()
    assert snap["epoch"] == last.epoch and snap["seq"] >= last.seq
    assert snap["page_size"] == PAGE and want <= set(snap["hashes"])
    assert msgspec.convert(snap["load"], ReplicaLoad) == ReplicaLoad()
    seqs = [e.seq for e in sub.events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gap, none repeated
    assert client.flush_cache() == {"flushed": True}
    cleared = sub.until(lambda e: e.cleared)
    assert cleared.epoch == last.epoch and sub.hashes == set()
    assert client.cache_snapshot()["hashes"] == []


def test_a_quiet_server_beats_once_a_second_and_not_more(sub):
    first = sub.until(lambda e: True, timeout=5)
    at = time.monotonic()
    second = sub.until(lambda e: True, timeout=5)
    assert time.monotonic() - at > 0.8
    assert second.seq == first.seq + 1 and not (second.stored or second.removed)
    assert second.load == ReplicaLoad()


def test_workers_call_to_a_server_is_invalid(client):
    with pytest.raises(ServerError, match="is a server, not a router") as err:
        client.workers("list")
    assert err.value.code == "invalid_request"
