"""Issue 41, finding 1: `n` x prompt logprobs multiplied one prefill into gigabytes (a
2,000-token prompt, n=128, top 100: the front door grew by 6.6 GB). A call's logprobs in all
(outputs x positions x (1 + top_logprobs_num), over its prompts and outputs) are bounded by
`max_logprob_entries`, refused before any work over RPC, `/generate` and the OpenAI
completions; the prompt's logprobs cross the RPC socket once per request, not once per
sample; and bob's calls leave alice unaffected (on the two-tenant harness)."""

from __future__ import annotations

from typing import Any

import httpx
import msgspec
import pytest

from radixserve.client import ServerError
from radixserve.config import EngineConfig
from radixserve.messages import ResultReply
from tests.server.attack_harness import (ALICE_KEY, BOB_KEY, AttackServer, assert_unaffected,
                                         attack_server, bearer)
from tests.server.test_fuzz import RawDealer

BOUND = EngineConfig().max_logprob_entries
"""The server runs with the default bound: the finding's call is far over it."""


def prompt_ids(tokens: int) -> list[int]:
    return [100 + (i * 37) % 5000 for i in range(tokens)]


FINDING: dict[str, Any] = {
    "input_ids": prompt_ids(1500), "return_logprob": True, "logprob_start_len": 0,
    "top_logprobs_num": 100, "sampling_params": {"n": 128, "max_new_tokens": 1}}
"""The finding's call, scaled to the tiny model: 128 x 1,500 x 101 = 19 million logprobs."""
BATCH: dict[str, Any] = {**FINDING, "input_ids": [prompt_ids(700)] * 2,
                         "sampling_params": {"n": 8, "max_new_tokens": 1}}
"""Two prompts each within the bound (8 x 700 x 101 = 565,600), over it together."""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with attack_server(tmp_path_factory) as s:
        yield s


def test_the_bound_is_refused_over_rpc_naming_it(server):
    for call in (FINDING, BATCH):
        with pytest.raises(ServerError) as err:
            server.bob.generate(**call)
        assert err.value.code == "invalid_request"
        assert f"max_logprob_entries={BOUND}" in err.value.message, err.value.message
        assert "outputs x positions" in err.value.message


def test_the_bound_is_refused_over_http_naming_it(server):
    with httpx.Client(base_url=server.http_url, headers=bearer(BOB_KEY), timeout=60) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        completion = {"model": model, "prompt": "Hi", "n": 128, "max_tokens": 1500,
                      "logprobs": 5}  # 128 x 1,500 x 6 output logprobs (OpenAI refuses echo)
        for path, body in (("/generate", FINDING), ("/v1/completions", completion)):
            r = http.post(path, json=body)
            assert r.status_code == 400, (path, r.status_code, r.text[:300])
            assert f"max_logprob_entries={BOUND}" in r.text, (path, r.text[:300])


def _frame_bytes(server: AttackServer, n: int) -> int:
    """The size of the result frame of an `n`-sample call with 200 prompt logprobs, top 5."""
    dealer = RawDealer(server.rpc_address)
    try:
        _, reply = dealer.answer(msgspec.msgpack.encode({
            "type": "generate", "call_id": n, "api_key": ALICE_KEY,
            "input_ids": prompt_ids(200), "return_logprob": True, "logprob_start_len": 0,
            "top_logprobs_num": 5,
            "sampling_params": {"n": n, "max_new_tokens": 2, "seed": 3}}))
    finally:
        dealer.close()
    assert isinstance(reply, ResultReply), reply
    return len(msgspec.msgpack.encode(reply))


def test_prompt_logprobs_cross_the_socket_once_per_request(server):
    one, eight = _frame_bytes(server, 1), _frame_bytes(server, 8)
    assert eight < 1.5 * one, (one, eight)  # per sample they were 8x
    # ...and every sample still shows them, as SGLang's result shape has it
    got = server.alice.generate(input_ids=prompt_ids(200), return_logprob=True,
                                logprob_start_len=0, top_logprobs_num=5,
                                sampling_params={"n": 8, "max_new_tokens": 2, "seed": 3})
    single = server.alice.generate(input_ids=prompt_ids(200), return_logprob=True,
                                   logprob_start_len=0, top_logprobs_num=5,
                                   sampling_params={"max_new_tokens": 2})
    want = single["meta_info"]
    assert len(got) == 8 and len(want["input_token_logprobs"]) == 200
    for out in got:
        assert out["meta_info"]["input_token_logprobs"] == want["input_token_logprobs"]
        assert out["meta_info"]["input_top_logprobs"] == want["input_top_logprobs"]


def test_bobs_n_times_prompt_logprobs_leave_alice_unaffected(server):
    """Before: alice's 4-token request took 33 s while bob's call ran, and the front door
    kept 4.3 GB. Now the finding's call is refused at once, and the largest of its kind
    that is allowed (here 16 x 300 x 101, half the bound) costs its prompt's logprobs once."""
    def attack(s: AttackServer) -> None:
        for _ in range(3):
            with pytest.raises(ServerError, match="max_logprob_entries"):
                s.bob.generate(**FINDING)
        for _ in range(2):
            outs = s.bob.generate(**{**FINDING, "input_ids": prompt_ids(300),
                                     "sampling_params": {"n": 16, "max_new_tokens": 2}})
            assert len(outs) == 16
            assert all(len(o["meta_info"]["input_top_logprobs"][1]) == 100 for o in outs)

    report = assert_unaffected(server, attack, max_latency_ratio=5, max_rss_growth_mib=400)
    print(report)
