"""The HTTP API over raw HTTP: SGLang-native /generate (single, batch, streamed), logprobs
against the Engine, bad requests, 100 concurrent streams with disconnects, metrics, and
SGLang's own benchmark client against the server."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from radixserve.client import ServerError

from tests.conftest import ABORT_RACE_PARAMS, assert_abort_ends_only_its_rid, require
from tests.server.conftest import API_KEY, AUTH, assert_idle_and_all_free
from tests.server.survival import assert_survived, baseline
from tests.test_engine_exact import QUESTIONS, SYSTEM, chat

GREEDY = {"max_new_tokens": 6, "temperature": 0}


def events(response: httpx.Response) -> list:
    """The `data:` payloads of a server-sent event stream, [DONE] as the string."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


class TestGenerate:
    def test_single_and_batch_equal_rpc(self, http, rpc):
        prompts = ["The capital of France is", "Once upon a time", "2 + 2 ="]
        want = rpc.generate(prompt=prompts, sampling_params=GREEDY)
        one = http.post("/generate", json={"text": prompts[0], "sampling_params": GREEDY})
        assert one.status_code == 200, one.text
        assert one.json()["output_ids"] == want[0]["output_ids"]
        assert one.json()["text"] == want[0]["text"]
        meta = one.json()["meta_info"]
        for key in ("id", "finish_reason", "prompt_tokens", "completion_tokens",
                    "cached_tokens"):
            assert key in meta
        batch = http.post("/generate", json={"text": prompts, "sampling_params": GREEDY}).json()
        assert isinstance(batch, list) and len(batch) == 3
        assert [b["output_ids"] for b in batch] == [w["output_ids"] for w in want]
        ids = http.post("/generate", json={"input_ids": [w["output_ids"] for w in want],
                                           "sampling_params": GREEDY, "rid": ["a", "b", "c"]})
        assert [r["meta_info"]["id"] for r in ids.json()] == ["a", "b", "c"]

    def test_stream_is_cumulative_and_ends_with_done(self, http, rpc):
        prompts = ["Count: 1, 2, 3,", "Emoji party: 🎉"]
        want = rpc.generate(prompt=prompts, sampling_params=GREEDY)
        with http.stream("POST", "/generate", json={
                "text": prompts[0], "sampling_params": GREEDY, "stream": True}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            got = events(r)
        assert got[-1] == "[DONE]"
        texts = [e["text"] for e in got[:-1]]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), texts
        assert texts[-1] == want[0]["text"]
        assert got[-2]["meta_info"]["finish_reason"]["type"] == "length"
        assert all("meta_info" in e for e in got[:-1])
        with http.stream("POST", "/generate", json={
                "text": prompts, "sampling_params": GREEDY, "stream": True}) as r:
            got = events(r)[:-1]
        last = {e["index"]: e for e in got}
        assert [last[i]["output_ids"] for i in range(2)] == [w["output_ids"] for w in want]

    def test_speculative_streams_the_same_text(self, http, rpc):
        """A request with speculation streams several tokens per step where its draft was
        accepted, and ends with the text and stop of the same request without it."""
        params = {"max_new_tokens": 24, "temperature": 0,
                  "stop_regex": r"(cherry, apple banana ){3}"}
        body = {"text": "apple banana cherry, " * 3, "sampling_params": params}
        want = rpc.generate(prompt=body["text"], sampling_params={**params, "speculative": "off"})
        with http.stream("POST", "/generate", json={
                **body, "sampling_params": {**params, "speculative": "lookup"},
                "stream": True}) as r:
            got = events(r)[:-1]
        texts = [e["text"] for e in got]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), texts
        assert texts[-1] == want["text"] and got[-1]["output_ids"] == want["output_ids"]
        meta = got[-1]["meta_info"]
        assert meta["finish_reason"] == want["meta_info"]["finish_reason"]
        assert want["meta_info"]["finish_reason"]["type"] == "stop"  # mid-run, as it happens
        assert meta["spec_accepted_tokens"] > 0, (meta, texts)
        assert want["meta_info"]["spec_draft_tokens"] == 0, (meta, texts)
        steps = [len(b["output_ids"]) - len(a["output_ids"]) for a, b in zip(got, got[1:])]
        assert max(steps) > 1, steps  # an accepted run arrives at once

    def test_input_logprobs_from_start_len_match_engine_even_when_cached(self, http, engine,
                                                                         tokenizer):
        ids = chat(tokenizer, QUESTIONS[2], SYSTEM)
        start = len(ids) - 6
        kw = dict(return_logprob=True, logprob_start_len=start, top_logprobs_num=2)
        want = engine.generate(input_ids=ids, sampling_params=GREEDY, **kw)["meta_info"]
        for attempt in range(2):  # the second finds the prompt's pages in the cache
            got = http.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY,
                                               "return_text_in_logprobs": True, **kw}).json()
            meta = got["meta_info"]
            if attempt:
                assert meta["cached_tokens"] >= start - 16, meta["cached_tokens"]
            assert len(meta["input_token_logprobs"]) == len(ids) - start
            for (a, ta, text), (b, tb, _) in zip(meta["input_token_logprobs"],
                                                 want["input_token_logprobs"]):
                assert ta == tb and text == tokenizer.decode([ta])
                assert (a is None) == (b is None) and (a is None or abs(a - b) < 1e-4)
            for (a, _, _), (b, _, _) in zip(meta["output_token_logprobs"],
                                            want["output_token_logprobs"]):
                assert abs(a - b) < 1e-4

    def test_abort_request_and_info_routes(self, http, rpc):
        outcome = {}
        thread = threading.Thread(target=lambda: outcome.update(http.post("/generate", json={
            "text": "Tell me a long story.", "rid": "abort-me",
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}).json()))
        thread.start()
        while rpc.stats()["running"] == 0 and thread.is_alive():
            time.sleep(0.05)
        aborted = http.post("/abort_request", json={"rid": "abort-me"})
        assert aborted.status_code == 200 and aborted.json() == {"aborted": ["abort-me"]}
        thread.join(60)
        assert outcome["meta_info"]["finish_reason"]["type"] == "abort"
        assert http.post("/flush_cache", params={"timeout": 30}).status_code == 200
        info = http.get("/get_model_info").json()
        assert info["is_generation"] and info["context_length"] == 8192
        assert http.get("/model_info").json() == info
        server = http.get("/get_server_info").json()
        assert server["internal_states"][0]["running"] == 0 and "api_key" not in server
        assert http.get("/server_info").status_code == 200
        assert http.get("/health_generate").status_code == 200

    @pytest.mark.parametrize("stream", [False, True])
    def test_rejected_sampled_request_is_answered_at_once(self, http, stream):
        """Issue 11, bug 1: the scheduler refuses the regex of an n=4 request; the client
        gets the 400 at once (a stream too: nothing was sent yet), not a hang."""
        body = {"text": "Hi", "stream": stream,
                "sampling_params": {"n": 4, "regex": "(unclosed", "max_new_tokens": 4}}
        warm = {"text": "Hi", "sampling_params": {"regex": "(unclosed"}}  # n=1, untimed:
        assert http.post("/generate", json=warm).status_code == 400  # builds the vocabulary
        # Refused at once, or never answered (the bug): a ReadTimeout after 30 s tells
        # them apart on a busy machine too.
        r = http.post("/generate", json=body, timeout=30)
        assert r.status_code == 400, r.text
        assert "regex" in r.json()["error"]["message"], r.text
        ok = http.post("/generate", json={"text": "Hi", "sampling_params": {**GREEDY, "n": 4}},
                       timeout=60)
        assert ok.status_code == 200 and len(ok.json()) == 4, ok.text

    def test_abort_request_leaves_rids_that_merely_start_with_it(self, http):
        """Issue 11, bug 2: /abort_request {"rid": "a"} ends "a", not a request "a:b"."""
        base = f"user-{uuid.uuid4().hex[:8]}"
        assert_abort_ends_only_its_rid(
            lambda rid: http.post("/generate", timeout=120, json={
                "text": "Tell me a long story.", "rid": rid,
                "sampling_params": ABORT_RACE_PARAMS}).json()["meta_info"],
            lambda: http.get("/get_server_info").json()["internal_states"][0]["running"],
            lambda rid: http.post("/abort_request", json={"rid": rid}).raise_for_status(),
            [base, f"{base}:b"])


class TestSGLangVocabulary:
    """What radixserve does with the rest of SGLang's sampling_params, on the RPC client and
    /generate alike (the Engine's own checks are tests/test_engine_vocabulary.py)."""

    COUNT = {"text": "Count: 1, 2, 3,", "sampling_params": {
        "max_new_tokens": 12, "temperature": 0, "stop_regex": r"[6-9],"}}

    def test_stop_regex_streams_only_what_stays(self, http, rpc):
        want = rpc.generate(prompt=self.COUNT["text"],
                            sampling_params=self.COUNT["sampling_params"])
        assert want["text"] == " 4, 5, "
        assert want["meta_info"]["finish_reason"] == {"type": "stop", "matched": r"[6-9],"}
        with http.stream("POST", "/generate", json={**self.COUNT, "stream": True}) as r:
            texts = [e["text"] for e in events(r)[:-1]]
        assert all(want["text"].startswith(t) for t in texts) and texts[-1] == want["text"]
        chunks = list(rpc.generate(prompt=self.COUNT["text"], stream=True,
                                   sampling_params=self.COUNT["sampling_params"]))
        assert "".join(c.get("text", "") for c in chunks) == want["text"]

    def test_ignored_settings_are_listed_on_every_surface(self, http, rpc):
        params = {**GREEDY, "stream_interval": 2, "custom_params": {"x": 1}}
        listed = ["stream_interval", "custom_params"]
        assert rpc.generate(prompt="Hi", sampling_params=params)["meta_info"][
            "ignored_params"] == listed
        assert http.post("/generate", json={"text": "Hi", "sampling_params": params}).json()[
            "meta_info"]["ignored_params"] == listed
        with http.stream("POST", "/generate", json={
                "text": "Hi", "sampling_params": params, "stream": True}) as r:
            assert events(r)[-2]["meta_info"]["ignored_params"] == listed

    def test_seed_alias_and_watermark(self, http, rpc):
        sampled = {"max_new_tokens": 6, "temperature": 0.9}
        want = rpc.generate(prompt="Hi", sampling_params={**sampled, "seed": 5})
        got = http.post("/generate", json={"text": "Hi", "sampling_params": {
            **sampled, "sampling_seed": 5}}).json()
        assert got["output_ids"] == want["output_ids"]
        for bad, field in (({"seed": 1, "sampling_seed": 2}, "sampling_seed"),
                           ({"watermark": {"enabled": True}}, "watermark")):
            r = http.post("/generate", json={"text": "Hi", "sampling_params": bad})
            assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
            with pytest.raises(ServerError, match=field):
                rpc.generate(prompt="Hi", sampling_params=bad)

    def test_beam_width_streams_its_answer_at_the_end(self, http, rpc):
        body = {"text": "The capital of France is", "sampling_params": {
            "max_new_tokens": 4, "beam_width": 2, "n": 2}}
        want = rpc.beam_search("The capital of France is", beam_width=2, max_new_tokens=4)
        got = http.post("/generate", json=body).json()
        assert [b["output_ids"] for b in got["meta_info"]["beam_results"]] == \
            [b["output_ids"] for b in want]
        with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
            streamed = events(r)
        assert len(streamed) == 2 and streamed[0]["output_ids"] == got["output_ids"]

    def test_profile_the_worker(self, http):
        started = http.post("/start_profile")  # as SGLang's benchmark calls it
        assert started.status_code == 200 and started.json()["profiling"], started.text
        assert http.post("/start_profile").status_code == 400  # one trace at a time
        http.post("/generate", json={"text": "Hi", "sampling_params": GREEDY})
        stopped = http.post("/stop_profile").json()
        trace = Path(stopped["trace"])
        assert stopped["steps"] >= GREEDY["max_new_tokens"] and trace.parent == \
            Path(started.json()["output_dir"])
        assert json.loads(trace.read_text())["traceEvents"]
        trace.unlink()
        assert http.post("/stop_profile").status_code == 400
        # A caller names at most a folder inside the server's profile directory.
        inside = Path(started.json()["output_dir"]) / "run-http"
        assert http.post("/start_profile", json={"output_dir": "run-http"}).json()[
            "output_dir"] == str(inside)
        assert Path(http.post("/stop_profile").json()["trace"]).parent == inside
        refused = http.post("/start_profile", json={"output_dir": "/tmp/elsewhere"})
        assert refused.status_code == 400 and "--profile-dir" in refused.text


def test_state_changing_routes_refuse_get(http, rpc):
    """Issue 25, class 8: a page on another site can make a browser GET a keyless server on
    localhost (an image, a link); flush and the profiler now take POST only."""
    before = baseline(rpc)
    for path in ("/flush_cache", "/start_profile", "/stop_profile"):
        r = http.get(path)
        assert r.status_code == 405, (path, r.text)
        assert "Method Not Allowed" in r.json()["error"]["message"], r.text
    assert_survived(rpc, before)


BAD = [  # (method, path, body: dict or raw bytes, headers, status, words the message holds)
    ("POST", "/v1/completions", b"{not json", AUTH, 400, ["JSON"]),
    ("POST", "/v1/completions", {"model": "smollm2-135m", "prompt": "x", "max_tokens": "8"},
     AUTH, 400, ["max_tokens", "int"]),
    ("POST", "/v1/completions", {"model": "gpt-4", "prompt": "x"}, AUTH, 404, ["gpt-4"]),
    ("POST", "/v1/chat/completions", {"model": "smollm2-135m"}, AUTH, 400, ["messages"]),
    ("POST", "/v1/completions", {"model": "smollm2-135m", "prompt": "x",
                                 "max_tokens": 100000}, AUTH, 400, ["max_tokens", "context"]),
    ("POST", "/v1/chat/completions", {"model": "smollm2-135m", "max_tokens": 9000,
                                      "messages": [{"role": "user", "content": "hi"}]},
     AUTH, 400, ["max_tokens"]),
    ("POST", "/v1/completions", {"model": "smollm2-135m", "prompt": "x", "n": 0}, AUTH, 400,
     ["n"]),
    ("POST", "/v1/completions", {"model": "smollm2-135m", "prompt": "x"},
     {"Authorization": "Bearer wrong"}, 401, ["API key"]),
    ("GET", "/v1/models", None, {}, 401, ["API key"]),
    ("POST", "/generate", {"text": "x", "sampling_params": {"max_tokens": 3}}, AUTH, 400,
     ["max_tokens"]),
    ("POST", "/generate", {"text": 5}, AUTH, 400, ["text"]),
    ("POST", "/generate", {"sampling_params": {}}, AUTH, 400, ["text", "input_ids"]),
    ("POST", "/generate", {"text": "x", "sampling_params": {"temperature": -1}}, AUTH, 400,
     ["temperature"]),
    ("POST", "/generate", {"text": "x", "lora_path": "a"}, AUTH, 400, ["lora_path"]),
    ("POST", "/generate", {"text": "x", "lora_name": "a"}, AUTH, 400, ["lora_name"]),
    ("POST", "/generate", {"text": "x", "lora_name": "a", "lora_path": "a"}, AUTH, 400,
     ["lora_name", "lora_path", "not both"]),
    ("POST", "/generate", {"text": "x", "stream": True,
                           "sampling_params": {"top_p": 3}}, AUTH, 400, ["top_p"]),
    ("GET", "/nowhere", None, AUTH, 404, ["Not Found"]),
]


def test_bad_requests_get_4xx_naming_the_problem(http_runtime, http):
    with httpx.Client(base_url=http_runtime.http_url, timeout=60) as bare:
        for method, path, body, headers, status, words in BAD:
            kw = {"content": body} if isinstance(body, bytes) else (
                {"json": body} if body is not None else {})
            r = bare.request(method, path, headers=headers, **kw)
            assert r.status_code == status, (path, body, r.status_code, r.text)
            error = r.json()["error"]
            assert set(error) >= {"message", "type", "param", "code"}, error
            assert isinstance(error["code"], str) and error["code"], error  # never a number
            assert status != 400 or error["code"] == "invalid_request", error
            for word in words:
                assert word in error["message"], (path, body, error)
        assert bare.get("/health").status_code == 200  # open without the key
    assert http.post("/generate", json={"text": "Still alive?", "sampling_params": GREEDY}
                     ).json()["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]


def test_100_streams_with_20_disconnects(http_runtime, rpc, tokenizer):
    systems = [SYSTEM, "You are terse. " * 20, "Reply in French. " * 15]
    rng = random.Random(0)
    prompts = [chat(tokenizer, f"{rng.choice(QUESTIONS)} (case {i})", systems[i % 3])
               for i in range(100)]
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    want = rpc.generate(input_ids=prompts[:30], sampling_params=params)
    dropped = set(range(0, 100, 5))
    aborted_before = rpc.stats()["aborted"]

    async def one(client: httpx.AsyncClient, i: int):
        long = {**params, "max_new_tokens": 2000}  # far from done when its client leaves
        if i % 2:  # the OpenAI route and the native one share the machinery; use both
            body = {"model": "smollm2-135m", "prompt": prompts[i], "stream": True,
                    "max_tokens": 2000 if i in dropped else 6, "temperature": 0,
                    "ignore_eos": True}
            path = "/v1/completions"
        else:
            body = {"input_ids": prompts[i], "stream": True,
                    "sampling_params": long if i in dropped else params}
            path = "/generate"
        async with client.stream("POST", path, json=body) as r:
            assert r.status_code == 200, await r.aread()
            got = []
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    got.append(line[6:])
                    if i in dropped:
                        return None  # leaving the block closes the connection mid-stream
            assert got[-1] == "[DONE]"
            return [json.loads(g) for g in got[:-1]]

    async def main():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=http_runtime.http_url, headers=AUTH,
                                     timeout=600, limits=limits) as client:
            return await asyncio.gather(*[one(client, i) for i in range(100)])

    results = asyncio.run(main())
    for i, got in enumerate(results):
        if i in dropped:
            continue
        if i % 2:
            text = "".join(c["text"] for e in got for c in e["choices"])
            assert got[-1]["choices"][0]["finish_reason"] == "length"
            if i < 30:
                assert text == want[i]["text"], i
        else:
            assert got[-1]["meta_info"]["completion_tokens"] == 6
            if i < 30:
                assert got[-1]["output_ids"] == want[i]["output_ids"], i
    deadline = time.monotonic() + 30  # the last aborts land within a step or two
    while rpc.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rpc.stats()["aborted"] - aborted_before == len(dropped)
    assert_idle_and_all_free(rpc)


def test_metrics_in_prometheus_format(http):
    http.post("/generate", json={"text": "Metrics please", "sampling_params": GREEDY})
    text = http.get("/metrics").text
    for name in ("radixserve_requests_total", "radixserve_generation_tokens_total",
                 "radixserve_prompt_tokens_total", "radixserve_cache_hit_rate",
                 "radixserve_kv_pool_usage", "radixserve_num_waiting_requests",
                 "radixserve_num_running_requests", "radixserve_time_to_first_token_seconds_bucket",
                 "radixserve_inter_token_latency_seconds_bucket", "radixserve_up 1.0"):
        assert name in text, name


@pytest.mark.parametrize("backend", ["sglang", "sglang-oai"])
def test_sglang_bench_serving_completes(http_runtime, model_dir, tmp_path, backend):
    """SGLang's benchmark client: GET /v1/models, warm-up, POST /flush_cache?timeout=...,
    then the generated-shared-prefix workload streamed over /generate or /v1/completions."""
    require("sglang")  # the shim runs it in its own process; missing, it is named here
    out = tmp_path / "bench.jsonl"
    env = {**os.environ, "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1",
           "OPENAI_API_KEY": API_KEY, "PYTHONPATH": os.pathsep.join(sys.path)}
    shim = Path(__file__).with_name("sglang_bench_shim.py")
    proc = subprocess.run(
        [sys.executable, str(shim), "--backend", backend, "--base-url", http_runtime.http_url,
         "--dataset-name", "generated-shared-prefix", "--tokenizer", str(model_dir),
         "--gsp-num-groups", "2", "--gsp-prompts-per-group", "4",
         "--gsp-system-prompt-len", "64", "--gsp-question-len", "16", "--gsp-output-len", "4",
         "--flush-cache", "--disable-tqdm", "--output-file", str(out)],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text().splitlines()[-1])
    assert result["completed"] == 8, result
    assert result["total_output_tokens"] == 8 * 4
