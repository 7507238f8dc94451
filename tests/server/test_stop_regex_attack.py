"""Unbounded matching work in a loop every request shares (issue 25, class 4): a
`stop_regex` that backtracks exponentially in Python's `re` over any text is matched by
RE2 in linear time, over RPC (plain and streamed) and HTTP, while a concurrent greedy
request finishes unchanged; a pattern RE2 cannot run is refused by name."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from radixserve.client import Client, ServerError
from tests.server.conftest import API_KEY
from tests.server.survival import REFERENCE_PARAMS, REFERENCE_PROMPT, assert_survived, baseline

EVIL = r"(?:(?s:.)|(?s:.))*\x00"
"""Two identical branches under a star, then a character no answer holds: `re` tries 2^n
ways over n characters of any text (some 30 characters already take seconds)."""
PROMPT = "Write a long sentence about the sea:"
PARAMS = {"max_new_tokens": 48, "temperature": 0}


def test_a_backtracking_stop_regex_answers_within_seconds(http_runtime, http, rpc):
    before = baseline(rpc)
    plain = rpc.generate(prompt=PROMPT, sampling_params=PARAMS)
    assert len(plain["text"]) >= 40  # `re` would try 2^40 ways over it
    evil = {**PARAMS, "stop_regex": EVIL}

    def over_rpc() -> dict:
        with Client(http_runtime.rpc_address, timeout=120, api_key=API_KEY) as c:
            return c.generate(prompt=PROMPT, sampling_params=evil)

    def streamed() -> str:
        with Client(http_runtime.rpc_address, timeout=120, api_key=API_KEY) as c:
            return "".join(chunk.get("text", "") for chunk in
                           c.generate(prompt=PROMPT, sampling_params=evil, stream=True))

    def over_http() -> dict:
        r = http.post("/generate", timeout=120,
                      json={"text": PROMPT, "sampling_params": evil})
        assert r.status_code == 200, r.text
        return r.json()

    def reference() -> list[int]:
        with Client(http_runtime.rpc_address, timeout=120, api_key=API_KEY) as c:
            return c.generate(prompt=REFERENCE_PROMPT,
                              sampling_params=REFERENCE_PARAMS)["output_ids"]

    started = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        jobs = [pool.submit(f) for f in (over_rpc, streamed, over_http, reference)]
        rpc_out, stream_text, http_out, ref_ids = [j.result(timeout=120) for j in jobs]
    assert time.monotonic() - started < 60
    assert ref_ids == before.output_ids  # the greedy request beside it: unchanged
    for out in (rpc_out, http_out):  # no stop: the whole answer, as without the pattern
        assert out["text"] == plain["text"]
        assert out["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
    assert stream_text == plain["text"]  # held back, then all given at the end
    assert_survived(rpc, before)


def test_a_pattern_re2_cannot_run_is_refused_by_name(http, rpc):
    before = baseline(rpc)
    for pattern in (r"(a)\1", r"(?<=a)b"):
        params = {**PARAMS, "stop_regex": ["fine", pattern]}
        r = http.post("/generate", json={"text": "Hi", "sampling_params": params})
        assert r.status_code == 400 and "stop_regex" in r.text and "RE2" in r.text, r.text
        try:
            rpc.generate(prompt="Hi", sampling_params=params)
        except ServerError as e:
            assert e.code == "invalid_request" and "sampling_params.stop_regex" in e.message
        else:
            raise AssertionError("refused over RPC")
    assert_survived(rpc, before)


def test_a_legitimate_stop_regex_still_stops_where_it_did(rpc):
    out = rpc.generate(prompt="Count: 1, 2, 3,", sampling_params={
        "max_new_tokens": 12, "temperature": 0, "stop_regex": r"[6-9],"})
    assert out["text"] == " 4, 5, "
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": r"[6-9],"}
