"""The official openai client against the server: completions and chat completions, plain and
streamed, n=2, stop sequences, logprobs, usage with cached tokens. Greedy answers equal the
RPC client's on the same server."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from radixserve.server.runtime import Runtime
from tests.server.conftest import API_KEY, assert_server_idle
from tests.test_engine_exact import QUESTIONS, SYSTEM, chat

MODEL = "smollm2-135m"
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
TOKENS = 6  # per answer: enough to compare, few forward steps


@pytest.fixture(scope="module")
def oai(http_runtime):
    with openai.OpenAI(base_url=http_runtime.http_url + "/v1", api_key=API_KEY,
                       max_retries=0, timeout=300) as client:
        yield client


def rpc_greedy(rpc, max_new_tokens: int = TOKENS, **kw):
    return rpc.generate(sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0},
                        **kw)


def test_models_lists_the_served_name(oai, model_dir):
    models = oai.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert oai.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4")


def test_completions_equal_rpc_plain_and_streamed(oai, rpc):
    want = rpc_greedy(rpc, prompt=PROMPTS)
    got = oai.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=TOKENS,
                                 temperature=0)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [w["text"] for w in want]
    assert got.usage.completion_tokens == sum(w["meta_info"]["completion_tokens"] for w in want)
    assert got.usage.prompt_tokens == sum(w["meta_info"]["prompt_tokens"] for w in want)
    assert got.usage.prompt_tokens_details.cached_tokens >= 0
    texts = {0: "", 1: "", 2: ""}
    reasons = {}
    for chunk in oai.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=TOKENS,
                                        temperature=0, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert [texts[i] for i in range(3)] == [w["text"] for w in want]
    assert reasons == {0: "length", 1: "length", 2: "length"}


def test_chat_equals_rpc_plain_and_streamed_with_usage(oai, rpc, tokenizer):
    question = QUESTIONS[0]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    want = rpc_greedy(rpc, input_ids=chat(tokenizer, question, SYSTEM))
    got = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=TOKENS,
                                      temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want["text"]
    assert got.usage.prompt_tokens == want["meta_info"]["prompt_tokens"]
    text, usage, roles = "", None, []
    for chunk in oai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}):
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            roles.append(c.delta.role)
    assert text == want["text"]
    assert roles[0] == "assistant"
    # The system prompt was computed by the calls above: this one found it cached.
    assert usage is not None and usage.completion_tokens == TOKENS
    cached = usage.prompt_tokens_details.cached_tokens
    assert usage.prompt_tokens - 2 * 16 <= cached < usage.prompt_tokens  # whole pages


def test_n2_and_stop_sequences(oai, rpc):
    greedy = rpc_greedy(rpc, prompt=PROMPTS[1], max_new_tokens=12)["text"]
    words = greedy.split()
    assert len(words) >= 3, greedy
    stop = " " + words[2]
    for stream in (False, True):
        result = oai.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12,
                                        temperature=0, stop=[stop], n=2, stream=stream)
        if stream:
            texts, reasons = {0: "", 1: ""}, {}
            for chunk in result:
                for c in chunk.choices:
                    texts[c.index] += c.text
                    reasons[c.index] = c.finish_reason or reasons.get(c.index)
        else:
            texts = {c.index: c.text for c in result.choices}
            reasons = {c.index: c.finish_reason for c in result.choices}
            assert result.usage.prompt_tokens == rpc_greedy(
                rpc, prompt=PROMPTS[1], max_new_tokens=1)["meta_info"]["prompt_tokens"]
        want = greedy[:greedy.index(stop)]
        assert texts == {0: want, 1: want}, (texts, greedy, stop)
        assert reasons == {0: "stop", 1: "stop"}
    sampled = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a joke."}], max_tokens=6,
        temperature=1.0, seed=7, n=2)
    assert [c.index for c in sampled.choices] == [0, 1]
    assert 2 <= sampled.usage.completion_tokens <= 12  # both choices counted
    assert all(c.message.content for c in sampled.choices)


def test_beam_search_as_vllm_spells_it(oai, rpc, tokenizer):
    """`use_beam_search` (vLLM's extension): the n best of best_of beams are the choices,
    equal to Client.beam_search's (which equal transformers', test_engine_samples.py), on
    completions and chat, plain and streamed; sampling settings with it are a 400."""
    beams = rpc.beam_search(PROMPTS[:2], beam_width=3, max_new_tokens=TOKENS)
    for stream in (False, True):
        got = oai.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=TOKENS, n=2,
                                     stream=stream, extra_body={"use_beam_search": True,
                                                                "best_of": 3})
        texts: dict[int, str] = {}
        for c in (c for chunk in got for c in chunk.choices) if stream else got.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
        assert texts == {2 * p + j: beams[p][j]["text"] for p in range(2) for j in range(2)}
    question = chat(tokenizer, QUESTIONS[1])
    want = rpc.beam_search(input_ids=question, beam_width=2, max_new_tokens=TOKENS)
    got = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTIONS[1]}], max_tokens=TOKENS,
        n=2, extra_body={"use_beam_search": True, "length_penalty": 1.0})
    assert [c.message.content for c in got.choices] == [b["text"] for b in want]
    for bad in ({"temperature": 0.7}, {"best_of": 1}, {"seed": 3}, {"best_of": 10**6}):
        with pytest.raises(openai.BadRequestError):
            oai.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, n=2,
                                   extra_body={"use_beam_search": True, **bad})
    with pytest.raises(openai.BadRequestError, match="use_beam_search"):
        oai.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2,
                               extra_body={"length_penalty": 0.5})


def test_logprobs_match_rpc(oai, rpc, tokenizer):
    want = rpc_greedy(rpc, prompt=PROMPTS[0], return_logprob=True, top_logprobs_num=2,
                      return_text_in_logprobs=True)["meta_info"]
    got = oai.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=TOKENS,
                                 temperature=0, logprobs=2).choices[0].logprobs
    assert len(got.tokens) == len(want["output_token_logprobs"]) == TOKENS
    for lp, (ref, _, _) in zip(got.token_logprobs, want["output_token_logprobs"]):
        assert abs(lp - ref) < 1e-4
    assert got.tokens == [text for _, _, text in want["output_token_logprobs"]]
    assert all(len(top) <= 2 for top in got.top_logprobs)
    assert got.text_offset[0] == 0
    content = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTIONS[3]}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    want = rpc_greedy(rpc, input_ids=chat(tokenizer, QUESTIONS[3]), max_new_tokens=5,
                      return_logprob=True, top_logprobs_num=2)["meta_info"]
    assert len(content) == 5
    for item, (ref, token_id, _) in zip(content, want["output_token_logprobs"]):
        assert abs(item.logprob - ref) < 1e-4
        assert item.token == tokenizer.decode([token_id])
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob


@pytest.fixture(scope="module")
def small_pool(model_dir):
    """A fresh server (its admission's new-token ratio still at its start, 0.7) whose KV
    pool of 9600 tokens is a little more than the model's context (8192)."""
    with Runtime(str(model_dir), max_total_tokens=9600, served_model_name=MODEL) as rt:
        yield rt
        assert_server_idle(rt.rpc_address)


def test_chats_without_max_tokens_are_admitted_together(small_pool):
    """Issue 11, bug 3: a chat without max_tokens may generate up to the context (about
    8150 tokens here), and admission reserved 0.7 of that, about 5.7k tokens: a second one
    fitted the pool only after ~60 steps of the first (as the ratio decays). With the
    estimate of future tokens clipped at 4096 (as SGLang does), three such chats fit the
    pool at once (3 x (0.7 x 4096 + ~50) < 9600) and start within a step or two of each
    other. Streamed, with ignore_eos so that none ends early; all stop once each has sent
    an event, or once one has sent `limit` events while another has sent none (before the
    fix: [25, 0, 0]; after: all three within two events of each other)."""
    limit = 25
    questions = QUESTIONS[:3]
    counts = [0] * len(questions)

    async def one(client: httpx.AsyncClient, i: int, stop: asyncio.Event) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": questions[i]}],
                "stream": True, "ignore_eos": True, "temperature": 0}
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    json.loads(line[6:])
                    counts[i] += 1
                    if min(counts) > 0 or max(counts) >= limit:
                        stop.set()

    async def main() -> None:
        stop = asyncio.Event()
        async with httpx.AsyncClient(base_url=small_pool.http_url, timeout=60) as client:
            waiter = asyncio.ensure_future(stop.wait())
            tasks = [asyncio.ensure_future(one(client, i, stop)) for i in range(len(questions))]
            try:
                await asyncio.wait([waiter, *tasks], timeout=60,
                                   return_when=asyncio.FIRST_COMPLETED)
                for task in tasks:  # one that ended already may have failed: say how
                    if task.done():
                        task.result()
            finally:  # closing the streams aborts their requests
                for task in [waiter, *tasks]:
                    task.cancel()
                await asyncio.gather(waiter, *tasks, return_exceptions=True)

    asyncio.run(main())
    assert min(counts) > 0 and max(counts) < limit, (
        f"events per stream when the last one started (or gave up): {counts}")
