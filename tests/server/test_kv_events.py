"""vLLM's KV events from a live server (`--kv-events`), read as llm-d's indexer, Dynamo and
vLLM's own subscriber example read them: three frames (topic, 8-byte big-endian sequence
number, msgpack batch), a replay socket answering a sequence number, and from 0 the whole
tree. Decoded with vLLM 0.34.0's classes as written in tests/vllm_subscriber.py, never
radixserve's own; with `llm-d` hashing, the block hashes are checked against keys computed
there from llm-d's documented recipe with `cbor2`. A tiny model."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from radixserve.client import Client
from radixserve.messages import CacheEvents
from radixserve.server.runtime import Runtime
from radixserve.transport.cache_events import operator_user, subscribe
from tests.factories import tiny_model_dir
from tests.server.conftest import assert_server_idle
from tests.server.sglang_router import free_port
from tests.vllm_subscriber import DECODER, Index, VllmAllBlocksCleared, VllmBatch
from tests.vllm_subscriber import llmd_keys as llmd_keys_of

PAGE, SEED, TOPIC = 4, "fleet-seed", "kv@pod-a@tiny"
PROMPT = [300 + 7 * i for i in range(30)]  # 7 whole pages and 2 tokens
GREEDY = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
ADMIN, TENANT = "sk-kv-operator", "sk-kv-tenant"


def llmd_keys(tokens: list[int], first_extra: list | None = None) -> list[int]:
    """llm-d's block keys of `tokens`, with `first_extra` on the first block."""
    return llmd_keys_of(tokens, PAGE, SEED, [first_extra] + [None] * (len(tokens) // PAGE))


class Live:
    """A SUB socket on the events: every message's frames checked as they come."""

    def __init__(self, ctx: zmq.Context, address: str, key: str | None = None) -> None:
        self.sock = subscribe(ctx, address, key)
        self.index, self.seqs, self.batches = Index(PAGE), [], []

    def until(self, done, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            assert left > 0 and self.sock.poll(int(left * 1000) + 1), "no such event"
            self._read()

    def drain(self, quiet: float = 0.5) -> None:
        """Read until nothing comes for `quiet` seconds (the server is idle)."""
        while self.sock.poll(int(quiet * 1000)):
            self._read()

    def _read(self) -> None:
        topic, seq, payload = self.sock.recv_multipart()
        assert topic == TOPIC.encode() and len(seq) == 8
        self.seqs.append(int.from_bytes(seq, "big"))
        self.batches.append(DECODER.decode(payload))
        self.index.apply(self.batches[-1].events)


def replay(ctx: zmq.Context, address: str, start: int, key: str | None = None,
           ) -> list[tuple[int, VllmBatch]]:
    """What vLLM's subscriber example does on a gap: a REQ asking from `start`."""
    req = ctx.socket(zmq.DEALER)  # a DEALER reads every message of the answer
    req.setsockopt(zmq.LINGER, 0)
    if key is not None:
        req.plain_username, req.plain_password = operator_user(key).encode(), key.encode()
    req.connect(address)
    req.send_multipart([b"", start.to_bytes(8, "big")])
    got = []
    while True:
        assert req.poll(20_000), "the replay never ended"
        empty, topic, seq, payload = req.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            assert payload == b"" and topic == b""
            req.close()
            return got
        got.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tiny = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")
    with Runtime(str(tiny), max_total_tokens=2048, page_size=PAGE, debug_invariants=True,
                 kv_events="llm-d", kv_events_seed=SEED, kv_events_port=0,
                 kv_events_replay_port=0, kv_events_topic=TOPIC) as rt:
        with Client(rt.rpc_address) as client:  # free ports: model_info names them
            info = client.model_info()
        yield rt, info["kv_events_address"], info["kv_events_replay_address"]
        assert_server_idle(rt.rpc_address)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def test_a_prompts_blocks_are_llmd_keys_published_in_order_and_replayed(server, ctx):
    rt, pub, rep = server
    live = Live(ctx, pub)
    time.sleep(0.3)  # the subscription reaches the PUB socket
    want = llmd_keys(PROMPT)
    with Client(rt.rpc_address, timeout=60) as client:
        client.generate(input_ids=PROMPT, sampling_params=GREEDY)
        live.until(lambda: set(want) <= set(live.index.blocks))
        live.drain()
        assert live.seqs == list(range(live.seqs[0], live.seqs[0] + len(live.seqs)))
        chain = [live.index.blocks[k] for k in want]
        assert [c[0] for c in chain] == [None, *want[:-1]]  # each page's parent
        assert [c[1] for c in chain] == [tuple(PROMPT[i:i + PAGE]) for i in range(0, 28, PAGE)]
        assert {c[2] for c in chain} == {"CPU"} and {c[4] for c in chain} == {None}

        # From 0: the whole tree, under the last batch's number, then the end.
        dump = replay(ctx, rep, 0)
        whole = Index(PAGE)
        for seq, batch in dump:
            assert seq == live.seqs[-1]
            whole.apply(batch.events)
        assert isinstance(dump[0][1].events[0], VllmAllBlocksCleared)
        assert whole.blocks == live.index.blocks
        # From a kept batch: that batch and every later one, as they were published.
        since = replay(ctx, rep, live.seqs[1])
        assert since == list(zip(live.seqs[1:], live.batches[1:]))

        # A flush is AllBlocksCleared; the radixserve events socket never carries blocks.
        plain = subscribe(ctx, client.model_info()["cache_events_address"], None)
        time.sleep(0.3)
        assert client.flush_cache() == {"flushed": True}
        live.until(lambda: not live.index.blocks)
        assert plain.poll(5000)
        assert msgspec.msgpack.decode(plain.recv(), type=CacheEvents).blocks == []


def test_malformed_and_flooded_replays_leave_the_server_serving(server, ctx):
    rt, pub, rep = server
    bad = ctx.socket(zmq.DEALER)
    bad.setsockopt(zmq.LINGER, 0)
    bad.connect(rep)
    bad.send_multipart([b"", b"123"])  # not 8 bytes
    bad.send_multipart([b"", b"x", b"y"])  # too many frames
    bad.send_multipart([b"", b"z" * 4096])  # over the socket's size: dropped unread
    with Client(rt.rpc_address, timeout=60) as client:
        client.generate(input_ids=PROMPT[:12], sampling_params=GREEDY)
        # 40 subscribers asking for the whole tree at once: each answered in full, at the
        # cost of one dump per round trip to the scheduler, not one each.
        answers: list[int] = []
        threads = [threading.Thread(target=lambda: answers.append(len(replay(ctx, rep, 0))))
                   for _ in range(40)]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(answers) == 40 and min(answers) >= 1
        assert time.monotonic() - started < 30
        out = client.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert len(out["output_ids"]) == 3
    assert not bad.poll(500)  # nothing was answered to the malformed requests


@pytest.fixture(scope="module")
def tenant_server(tmp_path_factory):
    tiny = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")
    ports = free_port(), free_port()
    with Runtime(str(tiny), max_total_tokens=2048, page_size=PAGE, debug_invariants=True,
                 api_key=[f"{TENANT}=tenant-b"], admin_api_key=ADMIN, kv_events="llm-d",
                 kv_events_seed=SEED, kv_events_port=ports[0], kv_events_replay_port=ports[1],
                 kv_events_topic=TOPIC) as rt:
        yield rt, f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}"
        assert_server_idle(rt.rpc_address, api_key=ADMIN)


def test_tenants_blocks_never_merge_and_only_the_operator_reads_them(tenant_server, ctx):
    rt, pub, rep = tenant_server
    stranger, operator = Live(ctx, pub), Live(ctx, pub, ADMIN)
    time.sleep(0.5)
    with Client(rt.rpc_address, timeout=60, api_key=TENANT) as tenant, \
            Client(rt.rpc_address, timeout=60, api_key=ADMIN) as admin:
        tenant.generate(input_ids=PROMPT, sampling_params=GREEDY)
        tenant.generate(input_ids=PROMPT, sampling_params=GREEDY, cache_salt="s1")
        admin.generate(input_ids=PROMPT, sampling_params=GREEDY)
        plain = llmd_keys(PROMPT)  # the operator is the default tenant: no salt
        operator.until(lambda: set(plain) <= set(operator.index.blocks))
        operator.until(lambda: len(operator.index.blocks) >= 3 * len(plain))
        firsts = [k for k, b in operator.index.blocks.items() if b[0] is None]
        salts = {operator.index.blocks[k][4] for k in firsts}
        assert len(firsts) == 3 and len(salts) == 3 and None in salts  # three namespaces
        for salt in salts - {None}:  # what the indexer computes, given the namespace's salt
            assert set(llmd_keys(PROMPT, list(salt))) <= set(operator.index.blocks)
        assert replay(ctx, rep, 0, ADMIN)[0][1].events[0] == VllmAllBlocksCleared()
    assert not stranger.sock.poll(1000)  # no handshake without the operator key
