"""The `Api` operations, checked once against each implementation: the in-process Engine, a
`Client` and an `AsyncClient` to a server (the package's `http_runtime`), and a `Client`
to a router in front of that same server. Each check ends with its runtime's KV-block
check (`assert_blocks_accounted` for the Engine, `assert_server_idle` for the server)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any

import pytest

from radixserve.api import ApiOf
from radixserve.client import AsyncClient, Client, ServerError
from tests.conftest import assert_blocks_accounted
from tests.hf_reference import assert_matches_reference
from tests.server.conftest import API_KEY, DRAINED_WITHIN, assert_server_idle
from tests.test_engine_exact import QUESTIONS, SYSTEM, chat

GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
IMPLEMENTATIONS = ["engine", "client", "async_client", "router"]


class BlockingAsync:
    """An `AsyncClient` driven from this thread, so that the same checks drive it: its
    calls run in an event loop of their own (another thread), and its streams, async
    iterators as it returns them, are read here one chunk at a time."""

    def __init__(self, address: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.client: AsyncClient = self._run(self._make(address))

    @staticmethod
    async def _make(address: str) -> AsyncClient:
        return AsyncClient(address, timeout=300, api_key=API_KEY)

    def _run(self, awaitable: Awaitable[Any]) -> Any:
        async def wait() -> Any:
            return await awaitable
        return asyncio.run_coroutine_threadsafe(wait(), self.loop).result(600)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.client, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            answer = self._run(method(*args, **kwargs))
            if not kwargs.get("stream"):
                return answer
            assert isinstance(answer, AsyncIterator), answer
            return self._read(answer)
        return call

    def _read(self, chunks: AsyncIterator[dict]) -> Iterator[dict]:
        while True:
            try:
                yield self._run(chunks.__anext__())
            except StopAsyncIteration:
                return

    def close(self) -> None:
        self._run(self.client.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def router(http_runtime):
    """A router with the package's server as its one replica."""
    from radixserve.router.runtime import RouterRuntime

    with RouterRuntime(replica=[http_runtime.rpc_address], api_key=API_KEY) as rt:
        yield rt


@pytest.fixture(params=IMPLEMENTATIONS)
def api(request) -> Iterator[Any]:
    """Each implementation of `Api` in turn, block-checked after the test."""
    if request.param == "engine":
        engine = request.getfixturevalue("engine")
        yield engine
        assert_blocks_accounted(engine)
        return
    runtime = request.getfixturevalue("http_runtime")
    if request.param == "client":
        yield request.getfixturevalue("rpc")
    elif request.param == "async_client":
        blocking = BlockingAsync(runtime.rpc_address)
        try:
            yield blocking
        finally:
            blocking.close()
    else:
        router = request.getfixturevalue("router")
        with Client(router.rpc_address, timeout=300, api_key=API_KEY) as client:
            yield client
    assert_server_idle(runtime.rpc_address, api_key=API_KEY)


def implementation(api: Any) -> Any:
    return api.client if isinstance(api, BlockingAsync) else api


def test_each_implementation_is_an_api(api):
    assert isinstance(implementation(api), ApiOf)


def test_greedy_generate_equals_the_reference(api, hf, tokenizer):
    ids = chat(tokenizer, QUESTIONS[0])
    out = api.generate(input_ids=ids, sampling_params=GREEDY)
    assert_matches_reference(out["output_ids"], hf.greedy(ids, GREEDY["max_new_tokens"]),
                             "greedy")
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    assert out["meta_info"]["prompt_tokens"] == len(ids)
    assert out["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]


def test_batch(api, hf, tokenizer):
    prompts = [chat(tokenizer, q, SYSTEM if i % 2 else None) for i, q in enumerate(QUESTIONS[:4])]
    outs = api.generate(input_ids=prompts, sampling_params=GREEDY)
    assert isinstance(outs, list) and len(outs) == len(prompts)
    for i, (ids, out) in enumerate(zip(prompts, outs)):
        assert_matches_reference(out["output_ids"], hf.greedy(ids, GREEDY["max_new_tokens"]),
                                 f"batch #{i}")
    samples = api.generate(["Hello", "Bonjour"], {**GREEDY, "n": 2})
    assert len(samples) == 4 and samples[0]["output_ids"] == samples[1]["output_ids"]


def test_stream(api):
    prompts = ["Write the word 'café' three times:", "Count: 1, 2, 3,"]
    params = {"max_new_tokens": 24, "temperature": 0, "stop": [" 7,"]}
    texts, tokens = {0: "", 1: ""}, {0: [], 1: []}
    chunks = list(api.generate(prompts, params, stream=True))
    for chunk in chunks[:-1]:
        texts[chunk["index"]] += chunk["text"]
        tokens[chunk["index"]] += chunk["token_ids"]
    final = chunks[-1]["final"]
    assert [r["output_ids"] for r in final] == \
        [r["output_ids"] for r in api.generate(prompts, params)]
    for i, result in enumerate(final):
        assert texts[i] == result["text"] and tokens[i] == result["output_ids"], i
    assert final[1]["meta_info"]["finish_reason"]["matched"] == " 7,"
    assert " 7," not in texts[1]
    one = list(api.generate("Hello", GREEDY, stream=True))
    assert one[-1]["final"]["output_ids"] == sum((c["token_ids"] for c in one[:-1]), [])


def test_abandoned_stream_is_aborted(api):
    chunks = api.generate("Count forever:", {**GREEDY, "max_new_tokens": 400}, stream=True)
    next(chunks)
    chunks.close()
    wait_idle(api)  # the abort lands within a step or two


def wait_idle(api: Any) -> None:
    deadline = time.monotonic() + DRAINED_WITHIN
    while (s := api.stats())["running"] or s["waiting"]:
        assert time.monotonic() < deadline, f"still busy {DRAINED_WITHIN} s on: {s}"
        time.sleep(0.05)


def test_pin_unpin_and_cache_info(api, request):
    prefix = SYSTEM + " Which bicycle?"
    if request.node.callspec.params["api"] == "router":
        # Pins and the cache view are one replica's (docs/router.md): refused, with where to go.
        for call in (lambda: api.pin_prefix(prefix), lambda: api.unpin_prefix(prefix),
                     api.unpin_all, api.cache_info):
            with pytest.raises(ServerError, match="replica's call") as refused:
                call()
            assert refused.value.code == "invalid_request"
        return
    pin = api.pin_prefix(prefix, ttl=600)
    assert pin["tokens"] > 200 and pin["tier"] == "memory" and 599 < pin["expires_in"] <= 600
    assert api.stats()["pinned_tokens"] == pin["pinned_tokens"] == pin["tokens"]
    info = api.cache_info(top=5)
    assert [p["tokens"] for p in info["pins"]] == [pin["tokens"]]
    assert info["pins"][0]["text"].startswith("You are a meticulous assistant")
    assert set(info["totals"]) == {"memory", "disk"}
    assert api.generate(prefix + " The red one?", GREEDY)["meta_info"]["cached_tokens"] \
        >= pin["tokens"]
    assert api.unpin_prefix(prefix)["unpinned"]
    assert not api.unpin_prefix(prefix)["unpinned"]
    api.pin_prefix(input_ids=list(range(100, 164)), cache_salt="s")
    dropped = api.unpin_all()
    assert dropped["unpinned"] and dropped["pins"] == 1 and dropped["pinned_tokens"] == 0
    assert api.cache_info()["pins"] == []


def test_stats_and_flush(api):
    api.generate(SYSTEM + " When do you open?", GREEDY)
    stats = api.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["cached_tokens"] > 0 and stats["num_blocks"] > 0
    flushed = api.flush_cache()
    assert flushed in (True, {"flushed": True})  # the Engine's bool, a client's dict (api.py)
    after = api.stats()
    assert after["cached_tokens"] == 0 and after["free_blocks"] == after["num_blocks"]
    assert api.health()["status"] == "ok"
    assert api.model_info()["max_total_tokens"] >= 8192


def test_abort_of_an_unknown_rid(api):
    assert api.abort("no-such-rid") == {"aborted": "no-such-rid"}
    assert api.generate("Hi", GREEDY, rid="no-such-rid")["meta_info"]["completion_tokens"] == 10


def test_async_streams_read_awaited_or_not(http_runtime):
    """`AsyncClient.generate(..., stream=True)` is read as SGLang's and OpenAI's async
    clients are (awaited, then iterated) or iterated at once; `generate_stream` too."""
    async def main() -> list[list[int]]:
        async with AsyncClient(http_runtime.rpc_address, timeout=300, api_key=API_KEY) as c:
            ids = []
            for chunks in (await c.generate("Hello", GREEDY, stream=True),
                           c.generate("Hello", GREEDY, stream=True),
                           c.generate_stream("Hello", GREEDY)):
                ids.append([chunk async for chunk in chunks][-1]["final"]["output_ids"])
            left = c.generate("Count forever:", {**GREEDY, "max_new_tokens": 400}, stream=True)
            await left.__anext__()
            await left.aclose()  # aborts it: the block check below waits for that
            ids.append((await c.generate("Hello", GREEDY))["output_ids"])
            return ids

    first, *others = asyncio.run(main())
    assert others == [first] * 3
    assert_server_idle(http_runtime.rpc_address, api_key=API_KEY)
