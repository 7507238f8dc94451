"""Overlap scheduling in the Engine's own loop, with the CPU worker: on by default only on
CUDA, it is forced on here through its test hook (`overlap.OVERLAP_DEVICES`). A tiny random
model (the real tokenizer) serves the same calls with it on and off and must give the same
tokens, finishing at the same point: greedy and seeded outputs, parallel samples, stop
tokens and strings, logprobs, retraction in a small pool, tensor parallelism, and the
requests that wait for each fold (a constraint, penalties). The placeholders are really
sent and resolved from the worker's kept tokens."""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Any, Iterator

import pytest

import radixserve.scheduler.overlap as overlap_module
from radixserve.worker.seq_rows import StepSeqs
from tests.conftest import checked_engine
from tests.factories import tiny_model_dir

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "My favourite food", "Hi", "List three prime numbers, then explain why each is prime."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Untied: a tied tiny model mostly repeats its last token, which a placeholder filled
    in wrong would repeat as well."""
    return tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models",
                          tie_word_embeddings=False)


@contextmanager
def engine(tiny, overlap: bool, monkeypatch: pytest.MonkeyPatch, **config: Any) -> Iterator[Any]:
    """An engine with overlap forced on (as on CUDA) or left off (the CPU's default)."""
    with monkeypatch.context() as patch:
        if overlap:
            patch.setattr(overlap_module, "OVERLAP_DEVICES", frozenset({"cuda", "cpu"}))
        with checked_engine(tiny, debug_invariants=True, **config) as eng:
            assert (eng.scheduler.overlap is not None) == overlap
            yield eng


def outputs(results: list[dict]) -> list[tuple[list[int], dict]]:
    return [(r["output_ids"], r["meta_info"]["finish_reason"]) for r in results]


@pytest.fixture
def kept(monkeypatch) -> Counter[str]:
    """How often the worker kept sampled tokens for placeholders, and filled them in."""
    seen: Counter[str] = Counter()
    real_keep, real_init = StepSeqs.keep_tokens, StepSeqs.__init__

    def keep(self, tokens):
        seen["kept"] += len(tokens)
        return real_keep(self, tokens)

    def init(self, rows, batch, *args):  # a step's input ids are filled in as it is made
        seen["filled"] += len(batch.placeholders)
        real_init(self, rows, batch, *args)

    monkeypatch.setattr(StepSeqs, "keep_tokens", keep)
    monkeypatch.setattr(StepSeqs, "__init__", init)
    return seen


def test_greedy_and_seeded_outputs_are_the_same_with_overlap(tiny, monkeypatch, kept) -> None:
    """Greedy and seeded calls, parallel samples, logprobs, a stop token and a stop string
    taken from the plain run's own output, so that both stop mid-way."""
    greedy = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    calls: list[tuple[list[str], Any, dict]] = [
        (PROMPTS, greedy, {}),
        (PROMPTS[:3], {"max_new_tokens": 12, "temperature": 0.8, "seed": 7, "n": 2}, {}),
        (PROMPTS[3:], greedy, {"return_logprob": True, "top_logprobs_num": 2}),
    ]
    results: dict[bool, list] = {}
    for overlap in (False, True):
        with engine(tiny, overlap, monkeypatch, max_total_tokens=8192) as eng:
            got = [eng.generate(p, sp, **kw) for p, sp, kw in calls]
            if not overlap:  # stops that fall inside the outputs just made
                first = got[0][0]["output_ids"]
                text = eng.tokenizer.decode(got[0][1]["output_ids"][6:8])
                calls.append(([PROMPTS[0]], {**greedy, "stop_token_ids": [first[5]]}, {}))
                calls.append(([PROMPTS[1]], {**greedy, "stop": [text]}, {}))
                got += [eng.generate(p, sp, **kw) for p, sp, kw in calls[3:]]
            results[overlap] = got
    for off, on in zip(results[False], results[True]):
        assert outputs(on) == outputs(off)
    for off, on in zip(results[False][2], results[True][2]):
        logprobs = [[entry[0] for entry in r["meta_info"]["output_token_logprobs"]]
                    for r in (off, on)]
        assert logprobs[1] == pytest.approx(logprobs[0], abs=1e-4)
    stopped = [r["meta_info"]["finish_reason"] for r in results[True][3] + results[True][4]]
    assert all(reason["type"] == "stop" for reason in stopped), stopped
    assert kept["filled"] > 0 and kept["filled"] <= kept["kept"]


def test_retraction_in_a_small_pool_with_overlap(tiny, monkeypatch, kept) -> None:
    """A pool too small for the batch: requests are retracted, some while their step is in
    flight, and each still ends with its tokens from a roomy run."""
    sampling = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    prompts = [p + " and then, after a long while," for p in PROMPTS]
    with engine(tiny, False, monkeypatch) as roomy:
        alone = outputs(roomy.generate(prompts, sampling))
    with engine(tiny, True, monkeypatch, max_total_tokens=160, page_size=4,
                init_new_token_ratio=0.05, min_new_token_ratio=0.0) as small:
        assert outputs(small.generate(prompts, sampling)) == alone
        assert small.stats()["retractions"] > 0
    assert kept["filled"] > 0


def test_requests_that_wait_for_each_fold(tiny, monkeypatch, kept) -> None:
    """A constraint's mask and penalties follow each token on the host: such requests run
    one fold at a time beside the others, and end as without overlap."""
    calls = [{"max_new_tokens": 8, "temperature": 0, "regex": "[0-9]{3}-[a-z]{2}"},
             {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True,
              "frequency_penalty": 0.5, "repetition_penalty": 1.2}]
    results = {}
    for overlap in (False, True):
        with engine(tiny, overlap, monkeypatch, max_total_tokens=8192) as eng:
            results[overlap] = [outputs(eng.generate(PROMPTS[:2], sp)) for sp in calls]
    assert results[True] == results[False]
    assert kept["filled"] == 0  # neither ever ran ahead of its token


def test_tensor_parallel_ranks_fill_the_same_placeholders(tiny, monkeypatch) -> None:
    """Two ranks: only rank 0 samples, and every rank keeps its tokens (shared on the
    device) for the placeholders each rank's model reads."""
    calls = [{"max_new_tokens": 10, "temperature": 0, "ignore_eos": True},
             {"max_new_tokens": 10, "temperature": 0.8, "seed": 3}]
    results = {}
    for overlap in (False, True):
        with engine(tiny, overlap, monkeypatch, tp_size=2, max_total_tokens=1024) as eng:
            results[overlap] = [outputs(eng.generate(PROMPTS[:3], sp)) for sp in calls]
    assert results[True] == results[False]
