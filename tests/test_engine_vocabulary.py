"""SGLang's sampling vocabulary on the Engine: min_new_tokens (as transformers' own),
stop_regex (trimmed, kept with no_stop_trim, named in the finish reason), stop tokens left
out of the text, sampling_seed, beam_width, the settings listed as ignored, watermark."""

from __future__ import annotations

import pytest

from tests.hf_reference import assert_matches_reference
from tests.test_engine_exact import chat

COUNT = "Count: 1, 2, 3,"
"""Greedy, the model goes on " 4, 5, 6, 7, ...", three tokens a number: ' ', '4', ','."""
GREEDY = {"max_new_tokens": 12, "temperature": 0}


def text_of(engine, **params) -> dict:
    return engine.generate(prompt=COUNT, sampling_params={**GREEDY, **params})


class TestMinNewTokens:
    def test_equals_transformers_min_new_tokens(self, engine, hf, tokenizer):
        ids = chat(tokenizer, "What is the capital of France?")
        free = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 24,
                                                               "temperature": 0})
        assert free["meta_info"]["finish_reason"]["type"] == "stop"  # EOS, early
        least = len(free["output_ids"]) + 4
        res = engine.generate(input_ids=ids, sampling_params={
            "max_new_tokens": 24, "temperature": 0, "min_new_tokens": least})
        assert len(res["output_ids"]) >= least
        assert not set(res["output_ids"][:least]) & engine.scheduler.eos_ids
        assert_matches_reference(res["output_ids"], hf.generate(ids, 24, min_new_tokens=least),
                                 "min_new_tokens")

    def test_stop_tokens_are_masked_until_then(self, engine):
        comma = 28
        assert text_of(engine)["output_ids"][2] == comma
        res = text_of(engine, stop_token_ids=[comma], min_new_tokens=4)
        assert comma not in res["output_ids"][:4]
        assert res["meta_info"]["finish_reason"] in ({"type": "stop", "matched": comma},
                                                     {"type": "length", "length": 12})

    def test_a_stop_string_counts_from_the_min_th_token(self, engine):
        """"," ends the 3rd and the 6th token: with 3 it stops at the first, with 4 at the
        second, and the text is cut there, not at the first."""
        at_3 = text_of(engine, stop=",", min_new_tokens=3)
        assert at_3["text"] == " 4" and len(at_3["output_ids"]) == 3
        at_4 = text_of(engine, stop=",", min_new_tokens=4)
        assert at_4["text"] == " 4, 5" and len(at_4["output_ids"]) == 6
        assert at_4["meta_info"]["finish_reason"] == {"type": "stop", "matched": ","}

    def test_at_most_max_new_tokens(self, engine):
        with pytest.raises(ValueError, match="min_new_tokens"):
            text_of(engine, min_new_tokens=13)


class TestStopRegex:
    def test_trimmed_and_named_in_the_finish_reason(self, engine):
        res = text_of(engine, stop_regex=[r"never\d", r"[6-9],"])
        assert res["text"] == " 4, 5, " and len(res["output_ids"]) == 9
        assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": r"[6-9],"}

    def test_no_stop_trim_keeps_the_match(self, engine):
        assert text_of(engine, stop_regex=r"[6-9],", no_stop_trim=True)["text"] == " 4, 5, 6,"
        assert text_of(engine, stop=" 5", no_stop_trim=True)["text"] == " 4, 5"

    def test_waits_for_min_new_tokens_too(self, engine):
        res = text_of(engine, stop_regex=r"\d,", min_new_tokens=4)
        assert res["text"] == " 4, " and len(res["output_ids"]) == 6

    @pytest.mark.parametrize("pattern, words", [("(", "not a valid regular expression"),
                                                ("a*", "matches the empty string")])
    def test_bad_patterns_are_refused_before_work(self, engine, pattern, words):
        before = engine.stats()["steps"]
        with pytest.raises(ValueError, match=rf"sampling_params\.stop_regex.*{words}"):
            engine.generate(prompt=["fine", COUNT], sampling_params=[
                {}, {"stop_regex": ["ok", pattern]}])
        assert engine.stats()["steps"] == before


def test_a_stop_token_is_left_out_of_the_text(engine):
    """As in SGLang (and vLLM): the token is in output_ids, its text only with no_stop_trim."""
    res = text_of(engine, stop_token_ids=[28])
    assert res["output_ids"] == [216, 36, 28] and res["text"] == " 4"
    assert text_of(engine, stop_token_ids=[28], no_stop_trim=True)["text"] == " 4,"


def test_sampling_seed_is_seeds_other_name(engine):
    sampled = {"max_new_tokens": 8, "temperature": 0.9}
    by_seed = text_of(engine, **sampled, seed=11)
    assert text_of(engine, **sampled, sampling_seed=11)["output_ids"] == by_seed["output_ids"]
    assert text_of(engine, **sampled, seed=11, sampling_seed=11)["output_ids"] == \
        by_seed["output_ids"]
    with pytest.raises(ValueError, match="sampling_seed"):
        text_of(engine, seed=1, sampling_seed=2)


def test_ignored_settings_are_listed_and_change_nothing(engine):
    plain = text_of(engine)
    assert "ignored_params" not in plain["meta_info"]
    res = text_of(engine, stream_interval=4, custom_params={"boost": 1})
    assert res["meta_info"]["ignored_params"] == ["stream_interval", "custom_params"]
    assert res["output_ids"] == plain["output_ids"]


def test_watermark_is_refused(engine):
    with pytest.raises(ValueError, match="watermark"):
        text_of(engine, watermark={"enabled": True, "key": "secret"})
    assert text_of(engine, watermark={"enabled": False})["output_ids"] == \
        text_of(engine)["output_ids"]


def test_beam_width_answers_as_sglang(engine):
    beams = engine.beam_search("The capital of France is", beam_width=3, max_new_tokens=6)
    res = engine.generate(prompt="The capital of France is",
                          sampling_params={"max_new_tokens": 6, "beam_width": 3, "n": 2})
    meta = res["meta_info"]
    assert res["output_ids"] == beams[0]["output_ids"] and res["text"] == beams[0]["text"]
    assert [b["output_ids"] for b in meta["beam_results"]] == \
        [b["output_ids"] for b in beams[:2]]
    assert [b["meta_info"]["sequence_score"] for b in meta["beam_results"]] == \
        pytest.approx([b["meta_info"]["beam_score"] for b in beams[:2]], abs=1e-5)
    assert meta["completion_tokens"] == sum(len(b["output_ids"]) for b in beams[:2])
    with pytest.raises(ValueError, match="beam_width"):
        engine.generate(prompt="Hi", sampling_params={"beam_width": 2, "n": 3})
    with pytest.raises(ValueError, match="min_new_tokens"):
        engine.generate(prompt="Hi", sampling_params={"beam_width": 2, "min_new_tokens": 1})
