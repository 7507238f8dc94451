"""Overlap scheduling through `serve`, across the process boundary: the scheduler process
sends step N+1 before it reads step N's answer, and the worker process fills N+1's
placeholders from the tokens it kept of N (server/processes.py:WorkerLoop). On by default only on
CUDA; forced on here by `RADIXSERVE_OVERLAP_DEVICES`, which the server's processes inherit.
Same calls on a server with it and one without: the same tokens, finishing at the same
point (greedy and seeded, parallel samples, logprobs, a stop string) in a pool small enough
that requests are retracted, and every KV block back at the end."""

from __future__ import annotations

from typing import Any

import pytest

from radixserve.client import Client
from radixserve.server.runtime import Runtime
from tests.factories import tiny_model_dir
from tests.server.conftest import assert_server_idle

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "My favourite food", "Hi", "List three prime numbers, then explain why each is prime."]
GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
CALLS: list[tuple[list[str], dict[str, Any], dict[str, Any]]] = [
    (PROMPTS, GREEDY, {}),
    (PROMPTS[:3], {"max_new_tokens": 12, "temperature": 0.8, "seed": 7, "n": 2}, {}),
    (PROMPTS[3:], GREEDY, {"return_logprob": True, "top_logprobs_num": 2}),
    (PROMPTS[:2], {**GREEDY, "stop": [" the", "("]}, {}),
]


def served(tiny: str, overlap: bool, monkeypatch: pytest.MonkeyPatch, **config: Any) -> list:
    with monkeypatch.context() as patch:
        if overlap:
            patch.setenv("RADIXSERVE_OVERLAP_DEVICES", "cuda,cpu")
        with Runtime(tiny, debug_invariants=True, **config) as rt:
            with Client(rt.rpc_address, timeout=300) as client:
                got = [[(r["output_ids"], r["meta_info"]["finish_reason"])
                        for r in client.generate(prompt=p, sampling_params=sp, **kw)]
                       for p, sp, kw in CALLS]
                stats = client.stats()
            assert_server_idle(rt.rpc_address)
    return [got, stats]


def test_the_same_tokens_with_overlap_through_serve(tmp_path_factory, monkeypatch) -> None:
    tiny = str(tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models",
                              tie_word_embeddings=False))
    off, _ = served(tiny, False, monkeypatch, max_total_tokens=8192)
    on, stats = served(tiny, True, monkeypatch, max_total_tokens=64, page_size=4,
                       init_new_token_ratio=0.05, min_new_token_ratio=0.0)
    assert on == off
    assert stats["retractions"] > 0, stats
    assert stats["steps_run_ahead"] > 0, stats
