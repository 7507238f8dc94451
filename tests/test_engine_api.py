"""The Engine's public surface: logprobs, sampling parameters, stops, n, aborts, bad input."""

from __future__ import annotations

import math

import pytest

from tests.conftest import ABORT_RACE_PARAMS, assert_abort_ends_only_its_rid
from tests.test_engine_exact import QUESTIONS, SYSTEM, chat

LOGPROB_TOL = 1e-4


class TestLogprobs:
    def _check(self, res, ids: list[int], start: int, hf) -> None:
        full = ids + res["output_ids"]
        ref = hf.logprobs(full)
        meta = res["meta_info"]
        inputs = meta["input_token_logprobs"]
        assert [t for _, t, _ in inputs] == ids[start:]
        for k, (lp, token, _) in enumerate(inputs):
            pos = start + k
            if pos == 0:
                assert lp is None
            else:
                assert abs(lp - float(ref[pos - 1, token])) < LOGPROB_TOL, (pos, lp)
        outputs = meta["output_token_logprobs"]
        assert [t for _, t, _ in outputs] == res["output_ids"]
        for k, (lp, token, _) in enumerate(outputs):
            assert abs(lp - float(ref[len(ids) + k - 1, token])) < LOGPROB_TOL, (k, lp)
        for k, top in enumerate(meta["output_top_logprobs"]):
            want = ref[len(ids) + k - 1].topk(3)
            assert [t for _, t, _ in top] == want.indices.tolist()
            assert all(abs(a[0] - b) < LOGPROB_TOL for a, b in zip(top, want.values.tolist()))

    @pytest.mark.parametrize("start", [0, 9])
    def test_input_and_output_logprobs_match_transformers(self, engine, hf, tokenizer, start):
        ids = chat(tokenizer, QUESTIONS[1])
        res = engine.generate(input_ids=ids,
                              sampling_params={"max_new_tokens": 5, "temperature": 0},
                              return_logprob=True, logprob_start_len=start, top_logprobs_num=3)
        self._check(res, ids, start, hf)

    def test_logprobs_when_the_prefix_is_cached(self, engine, hf, tokenizer):
        ids = chat(tokenizer, QUESTIONS[2], SYSTEM)
        engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})
        start = len(ids) - 20
        res = engine.generate(input_ids=ids,
                              sampling_params={"max_new_tokens": 4, "temperature": 0},
                              return_logprob=True, logprob_start_len=start, top_logprobs_num=3)
        assert res["meta_info"]["cached_tokens"] >= start - 16
        self._check(res, ids, start, hf)

    def test_text_in_logprobs(self, engine, tokenizer):
        res = engine.generate(prompt="The sky is", sampling_params={"max_new_tokens": 3},
                              return_logprob=True, return_text_in_logprobs=True)
        for lp, token, text in res["meta_info"]["output_token_logprobs"]:
            assert text == tokenizer.decode([token]) and lp <= 0


class TestSampling:
    PARAMS = {"max_new_tokens": 12, "temperature": 0.9, "top_p": 0.9, "top_k": 40, "min_p": 0.02}

    def test_seed_is_reproducible_in_any_batch(self, engine):
        alone = engine.generate(prompt="Tell me a story:",
                                sampling_params={**self.PARAMS, "seed": 7})
        batch = engine.generate(prompt=["Other prompt here", "Tell me a story:", "x y z"],
                                sampling_params={**self.PARAMS, "seed": 7})
        assert alone["output_ids"] == batch[1]["output_ids"]
        other = engine.generate(prompt="Tell me a story:",
                                sampling_params={**self.PARAMS, "seed": 8})
        assert other["output_ids"] != alone["output_ids"]

    def test_n_samples_share_the_prompt(self, engine, tokenizer):
        ids = chat(tokenizer, QUESTIONS[4], SYSTEM)
        results = engine.generate(input_ids=ids, sampling_params={**self.PARAMS, "n": 4, "seed": 1})
        assert len(results) == 4
        assert len({tuple(r["output_ids"]) for r in results}) > 1
        assert sum(r["meta_info"]["cached_tokens"] > 0 for r in results) >= 3

    def test_penalties_change_greedy_output(self, engine):
        base = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
        plain = engine.generate(prompt="1, 2, 1, 2, 1, 2,", sampling_params=base)
        penal = engine.generate(prompt="1, 2, 1, 2, 1, 2,",
                                sampling_params={**base, "repetition_penalty": 1.5,
                                                 "frequency_penalty": 1.0})
        assert plain["output_ids"] != penal["output_ids"]
        counts = lambda ids: max(ids.count(t) for t in set(ids))  # noqa: E731
        assert counts(penal["output_ids"]) < counts(plain["output_ids"])

    def test_logit_bias_moves_greedy_not_the_logprobs(self, engine):
        base = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
        args = dict(prompt="The capital of France is", return_logprob=True, top_logprobs_num=3)
        plain = engine.generate(**args, sampling_params=base)
        first = plain["output_ids"][0]
        banned = engine.generate(**args, sampling_params={**base, "logit_bias": {str(first): -100}})
        assert banned["output_ids"][0] != first
        forced = 42  # some token the model would never pick here
        assert forced not in plain["output_ids"]
        pushed = engine.generate(**args, sampling_params={**base, "logit_bias": {str(forced): 100}})
        assert pushed["output_ids"] == [forced] * 3
        # the logprobs are the model's: the first step's top-3 equal the unbiased run's
        tops = [m["meta_info"]["output_top_logprobs"][0] for m in (plain, banned, pushed)]
        assert tops[0] == tops[1] == tops[2]
        # OpenAI's bound: 301 entries are refused by name before any work
        with pytest.raises(ValueError, match="logit_bias.*300|300.*logit_bias"):
            engine.generate(prompt="Hi", sampling_params={
                **base, "logit_bias": {str(i): 1.0 for i in range(301)}})


class TestStops:
    def test_max_new_tokens_and_length_reason(self, engine):
        res = engine.generate(prompt="Count: 1, 2, 3,", sampling_params={
            "max_new_tokens": 5, "temperature": 0, "ignore_eos": True})
        assert len(res["output_ids"]) == 5
        assert res["meta_info"]["finish_reason"] == {"type": "length", "length": 5}

    def test_stop_string_trims_text(self, engine):
        free = engine.generate(prompt="Count: 1, 2, 3,", sampling_params={
            "max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert " 5," in free["text"]
        res = engine.generate(prompt="Count: 1, 2, 3,", sampling_params={
            "max_new_tokens": 12, "temperature": 0, "stop": [" 5,", "never"]})
        assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": " 5,"}
        assert res["text"] == free["text"][:free["text"].index(" 5,")]

    def test_stop_token_ids_and_eos(self, engine, tokenizer):
        free = engine.generate(prompt="Count: 1, 2, 3,", sampling_params={
            "max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
        target = free["output_ids"][2]
        res = engine.generate(prompt="Count: 1, 2, 3,", sampling_params={
            "max_new_tokens": 6, "temperature": 0, "stop_token_ids": [target]})
        assert res["output_ids"] == free["output_ids"][:3]
        assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}
        answer = engine.generate(input_ids=chat(tokenizer, "What is the capital of France?"),
                                 sampling_params={"max_new_tokens": 64, "temperature": 0})
        assert answer["meta_info"]["finish_reason"]["type"] == "stop"
        assert answer["output_ids"][-1] in engine.scheduler.eos_ids

    def test_zero_new_tokens_caches_the_prompt(self, engine, tokenizer):
        ids = chat(tokenizer, QUESTIONS[6], SYSTEM)
        res = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0})
        assert res["output_ids"] == [] and res["meta_info"]["finish_reason"]["type"] == "length"
        again = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})
        assert again["meta_info"]["cached_tokens"] >= len(ids) - 16

    def test_abort_frees_blocks(self, engine):
        import threading
        done = {}

        def run():
            done["r"] = engine.generate(prompt="Write a long essay.", rid="to-abort",
                                        sampling_params={"max_new_tokens": 400, "ignore_eos": True})

        t = threading.Thread(target=run)
        t.start()
        while engine.stats()["running"] == 0 and t.is_alive():
            pass
        engine.abort("to-abort")
        t.join(timeout=60)
        meta = done["r"]["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        assert meta["completion_tokens"] < 400


    def test_abort_of_a_rid_leaves_rids_that_merely_start_with_it(self, engine):
        """Issue 11, bug 2: abort("a") ends "a", not a request named "a:b"."""
        assert_abort_ends_only_its_rid(
            lambda rid: engine.generate(prompt="Write a long essay.", rid=rid,
                                        sampling_params=ABORT_RACE_PARAMS)["meta_info"],
            lambda: engine.stats()["running"], engine.abort, ["user-a", "user-a:b"])


class TestBadInput:
    @pytest.mark.parametrize("params, field", [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 5}, "max_tokens"),
        ({"max_new_tokens": "ten"}, "max_new_tokens"),
        ({"stop": 3}, "stop"),
        ({"top_k": 0}, "top_k"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"49152": 1}}, "logit_bias.*vocabulary"),
    ])
    def test_bad_sampling_params_name_the_field(self, engine, params, field):
        with pytest.raises((ValueError, TypeError), match=field):
            engine.generate(prompt="hello", sampling_params=params)

    def test_bad_prompts(self, engine):
        with pytest.raises(ValueError, match="empty"):
            engine.generate(prompt="")
        with pytest.raises(ValueError, match="context length"):
            engine.generate(input_ids=[1] * (engine.info.context_length + 1))
        with pytest.raises(TypeError, match="prompt"):
            engine.generate(prompt=42)
        with pytest.raises(TypeError, match="input_ids"):
            engine.generate(input_ids=["a", "b"])
        with pytest.raises(ValueError, match="exactly one"):
            engine.generate()
        with pytest.raises(ValueError, match="vocabulary"):
            engine.generate(input_ids=[10**9])
        with pytest.raises(ValueError, match="logprob_start_len"):
            engine.generate(prompt="hi", return_logprob=True, logprob_start_len=99)

    def test_prompt_longer_than_the_pool(self, make_engine):
        small = make_engine(max_total_tokens=512)
        with pytest.raises(ValueError, match="KV pool"):
            small.generate(input_ids=[1] * 500, sampling_params={"max_new_tokens": 20})

    def test_bad_item_rejects_the_batch_before_any_work(self, engine):
        before = engine.stats()["steps"]
        with pytest.raises(ValueError, match=r"sampling_params\[1\].*top_p"):
            engine.generate(prompt=["good", "bad"], sampling_params=[{}, {"top_p": 9}])
        assert engine.stats()["steps"] == before
        ok = engine.generate(prompt=["good", "fine"], sampling_params={"max_new_tokens": 2})
        assert all(r["meta_info"]["completion_tokens"] == 2 or
                   r["meta_info"]["finish_reason"]["type"] == "stop" for r in ok)

    def test_unknown_engine_option(self, model_dir):
        from radixserve import Engine
        with pytest.raises(TypeError, match="page_sise"):
            Engine(str(model_dir), page_sise=4)


def test_engine_stats_report_the_cache(engine, tokenizer):
    ids = chat(tokenizer, QUESTIONS[7], SYSTEM)
    engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 2})
    engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 2})
    s = engine.stats()
    assert 0 < s["cache_hit_rate"] <= 1 and s["hit_tokens"] > 0
    assert math.isclose(s["pool_usage"], 1 - s["free_blocks"] / s["num_blocks"])


def test_tree_hit_rate_counts_each_request_once(make_engine, tokenizer):
    """Issue 11, bug 5: a waiting request is looked up in the tree at each admission
    attempt; counting every attempt inflated the tree's `hit_rate` against the
    request-level `cache_hit_rate`. A 512-token pool and 64-token steps admit the 16
    requests (one system prompt, 214 tokens each) a few at a time: before the fix, 28
    lookups, 5184 hit tokens counted for 2880 cached."""
    engine = make_engine(max_total_tokens=512, chunked_prefill_size=64)
    system = SYSTEM[:len(SYSTEM) // 2]
    prompts = [chat(tokenizer, f"{QUESTIONS[i % len(QUESTIONS)]} (case {i})", system)
               for i in range(16)]
    engine.generate(input_ids=prompts, sampling_params={
        "max_new_tokens": 8, "ignore_eos": True, "temperature": 0})
    s = engine.stats()
    n = len(prompts)
    assert s["retractions"] == 0 and s["prompt_tokens"] == sum(map(len, prompts)), s
    counts = {k: s[k] for k in ("hit_rate", "cache_hit_rate", "hit_tokens", "miss_tokens",
                                "prompt_tokens", "prompt_cached_tokens")}
    # Once per request, at admission: the tree's hits are the prompts' cached tokens, and it
    # looked up each prompt once (all of it, or all but the last token, which must run).
    assert s["hit_tokens"] == s["prompt_cached_tokens"], counts
    looked_up = s["hit_tokens"] + s["miss_tokens"]
    assert s["prompt_tokens"] - n <= looked_up <= s["prompt_tokens"], counts
    assert abs(s["hit_rate"] - s["cache_hit_rate"]) <= n / (s["prompt_tokens"] - n), counts


def test_a_shut_down_engine_kept_alive_holds_no_model_or_pool(tmp_path, monkeypatch) -> None:
    """Benchmarks and notebooks keep an Engine in a variable while they build the next one,
    which sizes its pool from the memory left: after `shutdown` the old one must hold
    neither its model nor its KV pool (no reference from the core, the overlap pipeline or
    the decode graphs), freed at once, not at the next garbage collection."""
    import gc
    import weakref

    import radixserve
    import radixserve.scheduler.overlap as overlap
    from tests.factories import tiny_model_dir

    monkeypatch.setattr(overlap, "OVERLAP_DEVICES", frozenset({"cuda", "cpu"}))  # a pipeline
    engine = radixserve.Engine(model=str(tiny_model_dir(tmp_path)), device="cpu")
    engine.generate(prompt="Hi", sampling_params={"max_new_tokens": 2})
    model, pool = weakref.ref(engine.worker.model), weakref.ref(engine.worker.pool)
    gc.disable()
    try:
        engine.shutdown()
        assert model() is None and pool() is None
    finally:
        gc.enable()
    assert engine.core.worker is None and engine.core.pipeline is None
