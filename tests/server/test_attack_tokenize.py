"""Attack tests for issue 53's finding 4b (the front door tokenized a caller's whole batch
on the loop every call shares, before the bound that refused it), on the two-tenant
harness, with other sizes than the review's (1,599 prompts of 10k characters):

- A batch of 800 prompts of 12k characters whose last is over the context: refused at
  once, before any prompt is tokenized, naming the call's character bound.
- A batch under that bound whose last prompt is over the context: tokenized off the
  loop (bob's own queue), refused naming the context length and the prompt.
- Many mid-size prompts under every bound: served, tokenized off the loop.
In each, over RPC and HTTP in loops, alice's plain requests keep their latency.
"""

from __future__ import annotations

import random
import re
import statistics
import time
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from radixserve.client import ServerError
from tests.server.attack_harness import (BOB_KEY, AttackReport, AttackServer,
                                         assert_unaffected, attack_server, bearer)
from tests.server.test_attack_bounds import in_threads

LATENCY_RATIO, RSS_MIB = 3, 600
CALL_CHARS = 8_000_000
"""The server's `max_call_chars`: above the 8,192-token pool's default, so that calls
under it are large enough to take the loop for seconds if tokenized there."""
WORDS = ("information technology government development international environment management "
         "education production community experience performance political national "
         "important different university character generation relationship").split()


def fits(chars: int, seed: int) -> str:
    """~`chars` characters of ~10 a token (under the context at 12k), in words of three
    long ones, so that the tokenizer's word cache rarely helps: ~4 ms a prompt."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) + rng.choice(WORDS) + rng.choice(WORDS)
             for _ in range(chars // 30)]
    return " ".join(words)[:chars]


def over_context(chars: int, seed: int) -> str:
    """Random letters and punctuation: ~1.6 characters a token, so far over the context,
    yet under `max_prompt_chars` (10 characters per token of context)."""
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ,.;") for _ in range(chars))


def tokenizing_s(server: AttackServer, prompts: list[str]) -> float:
    """What tokenizing all of `prompts` takes here (a tenth of them, times ten)."""
    tokenizer = AutoTokenizer.from_pretrained(server.runtime.config.model)
    sample = prompts[::10]
    start = time.perf_counter()
    for p in sample:
        tokenizer.encode(p)
    return (time.perf_counter() - start) * len(prompts) / len(sample)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with attack_server(tmp_path_factory, max_call_chars=CALL_CHARS) as s:
        yield s


Outcome = tuple[float, Any, str]
"""One call of bob's: seconds it took, its status (200, or the error's code) and message."""


def bob_loops(prompts: list[str], params: dict[str, Any], seconds: float,
              outcomes: list[Outcome]) -> Any:
    """Bob's attack: the call of `prompts` over RPC and over HTTP, each in a loop for
    `seconds` (at least once), at once; what each call got is added to `outcomes` (the
    test asserts on them after alice's latencies, which the unfixed server failed first)."""
    def loop(send: Any) -> None:
        end = time.monotonic() + seconds
        while True:
            start = time.monotonic()
            status, message = send()
            outcomes.append((time.monotonic() - start, status, message))
            if time.monotonic() > end:
                return

    def rpc(s: AttackServer) -> tuple[Any, str]:
        try:
            return 200, f"{len(s.bob.generate(prompt=prompts, sampling_params=params))} outputs"
        except ServerError as e:
            return e.code, e.message

    def over_http(s: AttackServer) -> None:
        with httpx.Client(base_url=s.http_url, timeout=300, headers=bearer(BOB_KEY)) as h:
            def http() -> tuple[Any, str]:
                r = h.post("/generate", json={"text": prompts, "sampling_params": params})
                return r.status_code, (f"{len(r.json())} outputs" if r.status_code == 200
                                       else r.text)
            loop(http)

    return lambda s: in_threads(lambda: loop(lambda: rpc(s)), lambda: over_http(s))


def assert_alice_within_bound(report: AttackReport) -> None:
    """Every one of alice's requests within max(3x her unloaded latency, +2 s): the median
    (the harness's ratio) misses one request held for seconds while the others pass."""
    base = statistics.median(report.unloaded_s)
    assert max(report.loaded_s) < max(LATENCY_RATIO * base, base + 2.0), report


def test_a_batch_over_the_call_bound_is_refused_before_tokenizing(server: AttackServer):
    """800 prompts of 12k characters (9.6 MB), the last over the context: each call is
    refused within a second and in far less than tokenizing it would take, naming
    max_call_chars (the unfixed server tokenized all 800 on its loop, then refused naming
    the context length)."""
    prompts = [fits(12_000, i) for i in range(799)] + [over_context(12_000, 1)]
    outcomes: list[Outcome] = []
    report = assert_unaffected(server, bob_loops(prompts, {"max_new_tokens": 1}, 8, outcomes),
                               max_latency_ratio=LATENCY_RATIO, max_rss_growth_mib=RSS_MIB)
    whole = tokenizing_s(server, prompts)
    took = [round(t, 3) for t, _, _ in outcomes]
    print(report, f"; bob's calls: {took} s; tokenizing one here: {whole:.1f} s")
    assert_alice_within_bound(report)
    for _, status, message in outcomes:
        assert status in ("invalid_request", 400) and "max_call_chars" in message, message
    assert max(took) < min(1.0, whole / 4), (took, whole)


def test_a_batch_whose_last_prompt_is_over_the_context_is_tokenized_off_the_loop(
        server: AttackServer):
    """500 prompts of 10k characters (5 MB, under max_call_chars), the last over the
    context: refused naming the prompt and the context length, while alice's requests,
    tokenized on the loop, keep their latency (the unfixed loop was bob's meanwhile)."""
    prompts = [fits(10_000, i) for i in range(499)] + [over_context(10_000, 2)]
    outcomes: list[Outcome] = []
    report = assert_unaffected(server, bob_loops(prompts, {"max_new_tokens": 1}, 8, outcomes),
                               max_latency_ratio=LATENCY_RATIO, max_rss_growth_mib=RSS_MIB)
    print(report, f"; bob's calls: {[round(t, 3) for t, _, _ in outcomes]} s; tokenizing one "
          f"here: {tokenizing_s(server, prompts):.1f} s")
    assert_alice_within_bound(report)
    for _, status, message in outcomes:
        assert status in ("invalid_request", 400), (status, message[:300])
        assert re.search("prompt 499: prompt of .* tokens exceeds the model's maximum context "
                         "length", message), message[:300]


def test_many_mid_size_prompts_under_every_bound_are_served_off_the_loop(
        server: AttackServer):
    """48 prompts of 5k characters (~500 tokens), 1 token each: served; alice's requests
    keep their latency."""
    prompts = [fits(5_000, 1000 + i) for i in range(48)]
    outcomes: list[Outcome] = []
    report = assert_unaffected(server, bob_loops(prompts, {"max_new_tokens": 1,
                                                           "ignore_eos": True}, 4, outcomes),
                               max_latency_ratio=LATENCY_RATIO, max_rss_growth_mib=RSS_MIB)
    print(report, f"; bob's calls: {[round(t, 3) for t, _, _ in outcomes]} s")
    assert_alice_within_bound(report)
    assert all(o[1:] == (200, "48 outputs") for o in outcomes), outcomes
