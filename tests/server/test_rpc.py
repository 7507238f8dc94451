"""The three-process server through the RPC client, with the default model: same greedy
tokens as the in-process Engine, streaming, many concurrent clients, aborts, bad frames."""

from __future__ import annotations

import asyncio
import random
import threading
import uuid

import msgspec
import pytest
import zmq

from radixserve.client import AsyncClient, Client, ServerError
from radixserve.server.runtime import Runtime
from tests.conftest import ABORT_RACE_PARAMS, assert_abort_ends_only_its_rid
from tests.server.conftest import assert_idle_and_all_free, assert_server_idle
from tests.test_engine_exact import QUESTIONS, SYSTEM, chat

GREEDY = {"max_new_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def runtime(model_dir):
    with Runtime(str(model_dir), max_total_tokens=16384, debug_invariants=True) as rt:
        yield rt
        assert_server_idle(rt.rpc_address)


@pytest.fixture(scope="module")
def client(runtime):
    with Client(runtime.rpc_address, timeout=300) as c:
        yield c


class TestAgainstEngine:
    def test_mixed_batch_equals_engine(self, client, engine, tokenizer):
        prompts = [chat(tokenizer, q, SYSTEM if i % 2 else None)
                   for i, q in enumerate(QUESTIONS[:6])]
        prompts.append(tokenizer.encode("Once upon a time"))
        want = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        got = client.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
        assert [g["text"] for g in got] == [w["text"] for w in want]
        one = client.generate(prompt="The capital of France is", sampling_params=GREEDY)
        assert one["output_ids"] == engine.generate(prompt="The capital of France is",
                                                    sampling_params=GREEDY)["output_ids"]

    def test_logprobs_and_errors_cross_the_wire(self, client, engine):
        kw = dict(return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
        got = client.generate(prompt="Paris is", sampling_params=GREEDY, **kw)
        want = engine.generate(prompt="Paris is", sampling_params=GREEDY, **kw)
        for key in ("input_token_logprobs", "output_token_logprobs"):
            for (a, ta, _), (b, tb, _) in zip(got["meta_info"][key], want["meta_info"][key]):
                assert ta == tb and (a is None) == (b is None)
                assert a is None or abs(a - b) < 1e-4
        with pytest.raises(ServerError, match="top_p") as err:
            client.generate(prompt="x", sampling_params={"top_p": 7})
        assert err.value.code == "invalid_request"
        with pytest.raises(ServerError, match="max_tokens"):
            client.generate(prompt="x", sampling_params={"max_tokens": 7})
        with pytest.raises(ServerError, match="context length"):
            client.generate(input_ids=[1] * 9000)
        assert client.health()["status"] == "ok"
        info = client.model_info()
        assert info["context_length"] == 8192 and info["max_total_tokens"] == 16384


class TestForks:
    def test_beam_search_and_parallel_samples_equal_the_engine(self, client, runtime, engine):
        """Client.beam_search and AsyncClient.beam_search give the Engine's beams (which
        equal transformers', tests/test_engine_samples.py); n > 1 the Engine's samples."""
        kw = dict(beam_width=3, max_new_tokens=8)
        want = engine.beam_search(["The capital of France is", "def add(a, b):"], **kw)
        got = client.beam_search(["The capital of France is", "def add(a, b):"], **kw)
        assert [[b["output_ids"] for b in beams] for beams in got] == \
            [[b["output_ids"] for b in beams] for beams in want]
        for g, w in zip(got[0], want[0]):
            assert g["meta_info"]["beam_score"] == pytest.approx(w["meta_info"]["beam_score"],
                                                                 abs=1e-5)

        async def one() -> list[dict]:
            c = AsyncClient(runtime.rpc_address, timeout=300)
            try:
                return await c.beam_search("The capital of France is", **kw)
            finally:
                await c.close()

        assert [b["output_ids"] for b in asyncio.run(one())] == \
            [b["output_ids"] for b in want[0]]
        sampled = {"n": 3, "max_new_tokens": 8, "temperature": 0.8, "seed": 4}
        assert [r["output_ids"] for r in client.generate(prompt="Hello", sampling_params=sampled)] \
            == [r["output_ids"] for r in engine.generate(prompt="Hello", sampling_params=sampled)]
        with pytest.raises(ServerError, match="beam search does not support") as err:
            client.generate(prompt="Hi", sampling_params={"n": 2}, beam={"width": 2})
        assert err.value.code == "invalid_request"
        with pytest.raises(ServerError, match="does not support sampling_params.logit_bias"):
            client.generate(prompt="Hi", sampling_params={"logit_bias": {"5": 1}},
                            beam={"width": 2})


class TestStreaming:
    def test_chunks_concatenate_to_the_final_text(self, client):
        prompts = ["Write the word 'café' three times:", "Count: 1, 2, 3,", "Emoji party: 🎉"]
        params = {"max_new_tokens": 24, "temperature": 0, "stop": [" 7,"]}
        texts = {i: "" for i in range(3)}
        final = None
        for chunk in client.generate(prompt=prompts, sampling_params=params, stream=True):
            if "final" in chunk:
                final = chunk["final"]
            else:
                texts[chunk["index"]] += chunk["text"]
        assert final is not None
        for i, result in enumerate(final):
            assert texts[i] == result["text"], (texts[i], result["text"])
        assert final[1]["meta_info"]["finish_reason"]["matched"] == " 7,"
        assert " 7," not in texts[1]


class TestConcurrency:
    def test_100_clients_with_25_aborts(self, client, engine, tokenizer):
        """100 calls at once, far more prompt than one step prefills (so most wait their
        turn), a quarter of them streams abandoned after their first chunk while the others
        run: every other call gets its exact answer, and nothing is left running or holding
        a block."""
        systems = [SYSTEM, SYSTEM[::-1], "You are terse. " * 20, "Reply in French. " * 15]
        rng = random.Random(0)
        prompts = [chat(tokenizer, f"{rng.choice(QUESTIONS)} (case {i})", systems[i % 4])
                   for i in range(100)]
        params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
        want = engine.generate(input_ids=prompts[:40], sampling_params=params)
        results: dict[int, list[int]] = {}
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                if i % 4 == 1:  # 25 streams abandoned after their first chunk
                    stream = client.generate(input_ids=prompts[i], sampling_params={
                        **params, "max_new_tokens": 200}, stream=True)
                    next(stream)
                    stream.close()
                elif i % 2:
                    chunks = list(client.generate(input_ids=prompts[i], sampling_params=params,
                                                  stream=True))
                    results[i] = chunks[-1]["final"]["output_ids"]
                    assert sum((c.get("token_ids", []) for c in chunks[:-1]), []) == results[i]
                else:
                    results[i] = client.generate(input_ids=prompts[i],
                                                 sampling_params=params)["output_ids"]
            except BaseException as e:  # reported below with the index
                errors.append(e)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(100)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert not errors, errors[:3]
        assert len(results) == 75
        for i in range(40):
            if i in results:
                assert results[i] == want[i]["output_ids"], i
        assert_idle_and_all_free(client)


class TestAsyncClient:
    def test_async_generate_and_stream(self, runtime, engine):
        async def main():
            c = AsyncClient(runtime.rpc_address, timeout=300)
            try:
                outs = await asyncio.gather(*[
                    c.generate(prompt=f"Number {i} is", sampling_params=GREEDY) for i in range(4)])
                text = ""
                async for chunk in c.generate_stream(prompt="Number 0 is", sampling_params=GREEDY):
                    text += chunk.get("text", "")
                return outs, text, await c.health()
            finally:
                await c.close()

        outs, text, health = asyncio.run(main())
        want = engine.generate(prompt="Number 0 is", sampling_params=GREEDY)
        assert outs[0]["output_ids"] == want["output_ids"] and text == want["text"]
        assert health["status"] == "ok"


class TestMalformedFrames:
    def test_1000_bad_frames_each_get_an_error(self, runtime, client):
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(runtime.rpc_address)
        enc = msgspec.msgpack.encode
        rng = random.Random(1)
        bad = [
            lambda: rng.randbytes(rng.randint(0, 64)),
            lambda: enc({"type": "generate", "call_id": 5, "text": 3}),
            lambda: enc({"type": "generate", "call_id": 6, "text": "hi", "bogus": 1}),
            lambda: enc({"type": "nope", "call_id": 7}),
            lambda: enc({"type": "generate", "call_id": "x"})[:-1],
            lambda: b"\xdd\xff\xff\xff\xff",  # an array header claiming 4G elements
            lambda: enc({"type": "generate", "call_id": 8, "input_ids": [[1, "a"]]}),
            lambda: enc([1, 2, 3]),
        ]
        for i in range(1000):
            sock.send(bad[i % len(bad)]())
        replies = 0
        while replies < 1000 and sock.poll(30000):
            reply = msgspec.msgpack.decode(sock.recv())
            assert reply["type"] == "error", reply
            assert reply["code"] in ("malformed_frame", "invalid_request"), reply
            replies += 1
        sock.send_multipart([b"extra", b"frames"])
        assert sock.poll(10000)
        assert msgspec.msgpack.decode(sock.recv())["code"] == "malformed_frame"
        sock.close(0)
        ctx.term()
        assert replies == 1000
        assert client.generate(prompt="Still alive?", sampling_params=GREEDY)["output_ids"]


class TestRejectedRequests:
    """Issue 11, bug 1: a request the scheduler refuses (here a regex it cannot compile) is
    answered at once, also with n > 1 (the rejection names the request; its samples are
    outputs `(rid, index)` of it)."""

    @pytest.mark.parametrize("stream", [False, True])
    @pytest.mark.parametrize("n", [1, 4])
    def test_rejected_by_the_scheduler_is_answered_at_once(self, client, n, stream):
        params = {"n": n, "regex": "(unclosed", "max_new_tokens": 4}
        with pytest.raises(ServerError):  # untimed: the first regex builds the vocabulary
            client.generate(prompt="Hi", sampling_params={**params, "n": 1}, timeout=60)
        # Refused at once, or never answered (the bug: a hang until the call's 600 s): a
        # TimeoutError after 30 s tells them apart on a busy machine too.
        with pytest.raises(ServerError) as err:
            if stream:
                list(client.generate(prompt="Hi", sampling_params=params, stream=True,
                                     timeout=30))
            else:
                client.generate(prompt="Hi", sampling_params=params, timeout=30)
        assert err.value.code == "invalid_request" and "regex" in err.value.message, err.value
        assert client.generate(prompt="Hi", sampling_params={**GREEDY, "n": n},
                               timeout=60)  # and the server still serves


class TestAbortByRid:
    def test_abort_of_a_rid_leaves_rids_that_merely_start_with_it(self, client):
        """Issue 11, bug 2: abort("a") ends "a", not a user's request named "a:b"."""
        base = f"user-{uuid.uuid4().hex[:8]}"
        assert_abort_ends_only_its_rid(
            lambda rid: client.generate(prompt="Tell me a long story.", rid=rid,
                                        sampling_params=ABORT_RACE_PARAMS,
                                        timeout=120)["meta_info"],
            lambda: client.stats()["running"], client.abort, [base, f"{base}:b"])
