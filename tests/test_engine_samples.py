"""Parallel samples (`n` > 1) and beam search on copy-on-write KV blocks, against today's
independent requests and transformers' own beam search."""

from __future__ import annotations

import threading

import pytest

from tests.conftest import ENGINE_TEST_DEFAULTS, assert_blocks_accounted, checked_engine
from tests.factories import tiny_model_dir
from tests.hf_reference import assert_matches_reference

PROMPT = ("A lighthouse keeper writes to her sister about the winter storms, the ships she "
          "has guided home, and the long nights alone with the lamp. ")


def long_prompt(tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(PROMPT)
    return ids[:n]


class TestParallelSamples:
    @pytest.mark.parametrize("params", [
        {"temperature": 0.0},
        {"temperature": 0.9, "top_p": 0.95, "seed": 11},
    ], ids=["greedy", "seeded"])
    def test_n4_prefills_the_prompt_once_and_copies_at_most_one_block_each(
            self, make_engine, tokenizer, hf, params) -> None:
        engine = make_engine(page_size=16)
        ids = long_prompt(tokenizer, 600)  # 600 = 37 pages + 8 tokens: a shared partial block
        before = engine.stats()
        samples = engine.generate(input_ids=ids, sampling_params={
            **params, "n": 4, "max_new_tokens": 12, "ignore_eos": True})
        after = engine.stats()
        assert after["prefill_tokens"] - before["prefill_tokens"] == 600
        copies = after["copied_blocks"] - before["copied_blocks"]
        assert 1 <= copies <= 3  # the last writer keeps the original
        assert after["forked_samples"] - before["forked_samples"] == 3
        if params["temperature"] == 0:  # and greedy samples are transformers' tokens
            for sample in samples:
                assert_matches_reference(sample["output_ids"], hf.greedy(ids, 12), "n=4 fork")
        # Outputs equal what four independent requests give today (sample i: seed + i).
        engine.flush_cache()
        for i, sample in enumerate(samples):
            alone = {**params, "max_new_tokens": 12, "ignore_eos": True}
            if "seed" in params:
                alone["seed"] = params["seed"] + i
            assert sample["output_ids"] == engine.generate(
                input_ids=ids, sampling_params=alone)["output_ids"], f"sample {i}"
            assert sample["meta_info"]["prompt_tokens"] == 600

    def test_forks_under_eviction_and_retraction_keep_every_block(self, make_engine,
                                                                   tokenizer) -> None:
        engine = make_engine(max_total_tokens=640, page_size=4, chunked_prefill_size=64)
        ids = long_prompt(tokenizer, 150)
        results = engine.generate(input_ids=[ids, ids[:90], ids[30:]], sampling_params={
            "n": 3, "max_new_tokens": 40, "ignore_eos": True, "temperature": 0.7, "seed": 3})
        assert [len(r["output_ids"]) for r in results] == [40] * 9
        s = engine.stats()
        assert s["retractions"] > 0 or s["evicted_tokens"] > 0, s
        assert_blocks_accounted(engine, flush=False)

    def test_fork_with_logprobs_and_an_early_stop(self, make_engine, tokenizer) -> None:
        engine = make_engine()
        ids = tokenizer.encode("Name three colours:")
        out = engine.generate(input_ids=ids, return_logprob=True, logprob_start_len=0,
                              sampling_params={"n": 3, "max_new_tokens": 1})
        assert [len(r["output_ids"]) for r in out] == [1, 1, 1]
        for r in out:
            assert len(r["meta_info"]["input_token_logprobs"]) == len(ids)
            assert len(r["meta_info"]["output_token_logprobs"]) == 1
        zero = engine.generate(input_ids=ids, sampling_params={"n": 2, "max_new_tokens": 0})
        assert [r["output_ids"] for r in zero] == [[], []]


class TestForkBranches:
    def test_branches_copy_the_committed_prefix_last_page(self, make_engine, tokenizer,
                                                          hf) -> None:
        """A DSL fork commits its prefix (a zero-token request), then each branch sends the
        prefix plus its own text: the part-filled last page of the prefix is copied for
        each branch, not recomputed, and the outputs equal the cache-off engine's."""
        engine = make_engine(page_size=16)
        prefix = long_prompt(tokenizer, 16 * 6 + 11)  # 11 tokens into the seventh page
        branches = [prefix + tokenizer.encode(f" Idea {i}: a lamp that") for i in range(3)]
        greedy = {"max_new_tokens": 8, "temperature": 0.0}
        engine.generate(input_ids=prefix, sampling_params={"max_new_tokens": 0})
        before = engine.stats()
        outs = engine.generate(input_ids=branches, sampling_params=greedy)
        after = engine.stats()
        suffixes = sum(len(b) - len(prefix) for b in branches)
        assert after["prefill_tokens"] - before["prefill_tokens"] == suffixes
        assert after["partial_tokens"] - before["partial_tokens"] == 3 * 11
        assert [o["meta_info"]["cached_tokens"] for o in outs] == [len(prefix)] * 3
        for branch, out in zip(branches, outs):
            want = hf.greedy(branch, 8, eos=set(engine.scheduler.eos_ids))
            assert_matches_reference(out["output_ids"], want, "branch")
        plain = make_engine(enable_prefix_cache=False)
        assert [o["output_ids"] for o in outs] == [
            o["output_ids"] for o in plain.generate(input_ids=branches, sampling_params=greedy)]


BEAM_PROMPTS = ["The capital of France is", "def fibonacci(n):"]


class TestBeamSearch:
    @pytest.mark.parametrize("width", [2, 4])
    @pytest.mark.parametrize("config", [
        {}, {"enable_prefix_cache": False}, {"max_total_tokens": 96, "page_size": 4},
    ], ids=["cache", "nocache", "evicting"])
    def test_equals_transformers_beam_search(self, make_engine, tokenizer, hf, width,
                                             config) -> None:
        engine = make_engine(**config)
        for prompt in BEAM_PROMPTS:
            ids = tokenizer.encode(prompt)
            beams = engine.beam_search(input_ids=ids, beam_width=width, max_new_tokens=10)
            ref = hf.beam_search(ids, width, 10)
            assert [b["output_ids"] for b in beams] == [tokens for tokens, _ in ref], prompt
            for b, (_, score) in zip(beams, ref):
                assert b["meta_info"]["beam_score"] == pytest.approx(score, abs=1e-4)
                assert b["text"] == tokenizer.decode(b["output_ids"], skip_special_tokens=True)

    def test_length_penalty_and_early_stopping_follow_transformers(self, make_engine, tokenizer,
                                                                   hf) -> None:
        engine = make_engine()
        ids = tokenizer.encode("Once upon a time")
        for options in ({"length_penalty": 0.0}, {"length_penalty": 2.0, "early_stopping": True}):
            beams = engine.beam_search(input_ids=ids, beam_width=3, max_new_tokens=8, **options)
            ref = hf.beam_search(ids, 3, 8, **options)
            assert [b["output_ids"] for b in beams] == [t for t, _ in ref], options
            assert [b["meta_info"]["beam_score"] for b in beams] == pytest.approx(
                [s for _, s in ref], abs=1e-4)

    def test_concurrent_searches_in_a_tiny_pool_finish_as_alone(self, tmp_path_factory) -> None:
        """Four searches whose beams cannot all be resident at once: beams are retracted
        (keeping the step they have done) and forked from retracted parents, and every
        search still ends with the beams it gets in a roomy pool. The engine against
        itself, so a tiny random model (the real tokenizer) does: the scheduling is what
        is tested."""
        model = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")
        prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
                   "My favourite food"]
        with checked_engine(model, **ENGINE_TEST_DEFAULTS) as roomy:
            alone = {p: roomy.beam_search(p, beam_width=4, max_new_tokens=16) for p in prompts}
        got: dict[str, list[dict]] = {}
        with checked_engine(model, max_total_tokens=96, debug_invariants=True, page_size=4,
                            init_new_token_ratio=0.05, min_new_token_ratio=0.0) as tiny:
            threads = [threading.Thread(target=lambda p=p: got.update(
                {p: tiny.beam_search(p, beam_width=4, max_new_tokens=16)})) for p in prompts]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert tiny.stats()["retractions"] > 0
        for p in prompts:
            assert [b["output_ids"] for b in got[p]] == [b["output_ids"] for b in alone[p]], p

    def test_a_batch_and_bad_arguments(self, make_engine) -> None:
        engine = make_engine()
        out = engine.beam_search(BEAM_PROMPTS, beam_width=2, max_new_tokens=4)
        assert [len(beams) for beams in out] == [2, 2]
        with pytest.raises(ValueError, match="beam"):
            engine.beam_search("Hi", beam_width=0)
        with pytest.raises(ValueError, match="max_new_tokens"):
            engine.beam_search("Hi", max_new_tokens=0)
