"""Regex-constrained decoding through the Engine: outputs match, EOS only where the match
may end, bad patterns rejected before any work; the token-level index and masks."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from radixserve.scheduler.grammar import GrammarState
from radixserve.scheduler.grammar_compiler import GrammarCompiler, token_bytes
from tests.test_engine_exact import chat

PROMPT_Q = "How tall is the Eiffel tower, in metres? Answer with a number."


class TestRegexIndex:
    def test_token_bytes_spell_the_vocabulary(self, model_dir, tokenizer):
        spelled = token_bytes(json.loads((model_dir / "tokenizer.json").read_text()))
        for text in (" hello", "12", "\n\n", " é"):
            ids = tokenizer.encode(text)
            assert b"".join(spelled[i] for i in ids) == text.encode()
        for special in tokenizer.all_special_ids:
            assert special not in spelled

    def test_grammars_are_compiled_once_and_cached(self, model_dir, engine):
        compiler = GrammarCompiler(model_dir, engine.info.vocab_size, [2])
        compiled = compiler.compile("regex", r"[0-9]{2}")
        assert compiler.compile("regex", r"[0-9]{2}") is compiled and compiler.compiles == 1
        assert compiled.build_seconds < 5
        mask = GrammarState(compiled, ignore_eos=False).mask()
        assert len(mask) == -(-engine.info.vocab_size // 8)
        bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
        spelled = token_bytes(json.loads((model_dir / "tokenizer.json").read_text()))
        digits = [i for i, b in spelled.items() if len(b) == 1 and b.isdigit()]
        assert np.flatnonzero(bits).tolist() == sorted(digits)  # EOS not yet: no match so far


class TestRegexDecoding:
    def test_sampled_outputs_match_and_finish(self, engine, tokenizer):
        pattern = r"(yes|no), [0-9]{1,3} m"
        outs = engine.generate(input_ids=[chat(tokenizer, PROMPT_Q)] * 8, sampling_params={
            "max_new_tokens": 16, "temperature": 1.0, "regex": pattern, "seed": 3})
        for out in outs:
            assert re.fullmatch(pattern, out["text"]), out["text"]
            assert out["meta_info"]["finish_reason"]["type"] == "stop"

    def test_greedy_is_the_best_allowed_token(self, engine, tokenizer):
        ids = chat(tokenizer, PROMPT_Q)
        free = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 4,
                                                               "temperature": 0})
        digits = engine.generate(input_ids=ids, sampling_params={
            "max_new_tokens": 4, "temperature": 0, "regex": r"[0-9]+"})
        assert re.fullmatch(r"[0-9]+", digits["text"])
        if re.match(r"[0-9]", free["text"]):  # where the model already wants digits, same token
            assert digits["output_ids"][0] == free["output_ids"][0]

    def test_eos_only_in_accepting_states(self, engine, tokenizer):
        # "[0-9]+" accepts after one digit, so EOS (the chat model's <|im_end|>) may end it;
        # with ignore_eos the request runs to its length.
        ids = chat(tokenizer, PROMPT_Q)
        out = engine.generate(input_ids=ids, sampling_params={
            "max_new_tokens": 6, "temperature": 0, "regex": r"[0-9]+", "ignore_eos": True})
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert len(out["output_ids"]) == 6 and out["text"].isdigit()

    def test_bad_patterns_are_rejected(self, engine):
        with pytest.raises(ValueError, match="sampling_params.regex"):
            engine.generate(prompt="x", sampling_params={"regex": "(?<=a)b"})
        with pytest.raises(ValueError, match="regex"):
            engine.generate(prompt="x", sampling_params={"regex": ""})


def test_stop_reports_the_earliest_of_several_matches():
    """A token that completes two stop strings at once ("\\n " for [" ", "\\n"]) reports
    the one that comes first, so the text is trimmed there (dtype=int relies on it)."""
    from radixserve.messages import SamplingParams
    from radixserve.scheduler.request import Req
    from radixserve.scheduler.finish import check_finish

    req = Req(rid="r", index=0, input_ids=[1], sampling=SamplingParams(stop=[" ", "\n"]),
              seed=0)
    req.output_ids = [7, 8]
    pieces = {7: "882", 8: "\n "}
    reason = check_finish(req, set(), lambda ids, **flags: "".join(pieces[i] for i in ids))
    assert reason == {"type": "stop", "matched": "\n"}
