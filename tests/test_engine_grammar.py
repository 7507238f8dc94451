"""Structured outputs through the Engine: JSON schemas (sampled and greedy outputs always
parse and validate), any JSON object, EBNF, structural tags; bad constraints refused before
any work; each constraint compiled once. Regex-specific behaviour: test_engine_regex.py."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from radixserve.scheduler.grammar import GrammarState
from tests.test_engine_exact import chat

EMPLOYEE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "manager": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 1,
                                                 "maximum": 9}]},
    },
    "required": ["name", "age", "role", "address", "tags"],
}
"""Nested objects, arrays, enums, bounded integers, anyOf, required and optional keys; every
string bounded, so an output always fits in max_new_tokens."""

ANY_OBJECT = '{"type": "object"}'
"""OpenAI's `response_format: {"type": "json_object"}`, spelled as SGLang maps it."""

WEATHER_TAG = {"type": "structural_tag", "triggers": ["<function="], "structures": [{
    "begin": "<function=get_weather>", "end": "</function>",
    "schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
               "required": ["city"]}}]}


EOS = 2
"""`<|im_end|>`, the chat model's EOS."""


def allowed(state: GrammarState, token: int) -> bool:
    mask = np.frombuffer(state.mask(), dtype=np.uint8)
    return bool(mask[token // 8] >> (token % 8) & 1)


class TestJsonSchema:
    def test_sampled_outputs_parse_and_validate(self, engine, tokenizer):
        ids = chat(tokenizer, "Describe a fictional employee as JSON.")
        schema = json.dumps(EMPLOYEE)
        # Four seeds, two samples each: every sample has its own matcher (n > 1 forks).
        outs = engine.generate(input_ids=[ids] * 4, sampling_params=[
            {"max_new_tokens": 120, "temperature": 1.0, "seed": 10 * s, "n": 2,
             "json_schema": schema} for s in range(4)])
        assert len({o["text"] for o in outs}) > 1
        for out in outs:
            assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": None}, out
            jsonschema.validate(json.loads(out["text"]), EMPLOYEE)

    def test_greedy_output_parses_and_validates(self, engine, tokenizer):
        out = engine.generate(input_ids=chat(tokenizer, "Describe a fictional employee as JSON."),
                              sampling_params={"max_new_tokens": 120, "temperature": 0,
                                               "json_schema": json.dumps(EMPLOYEE)})
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        jsonschema.validate(json.loads(out["text"]), EMPLOYEE)

    def test_any_json_object(self, engine, tokenizer):
        questions = ['Reply with a JSON object whose key "ok" is true.',
                     'Give the capital of France as JSON, e.g. {"capital": "..."}.']
        outs = engine.generate(input_ids=[chat(tokenizer, q) for q in questions],
                               sampling_params={"max_new_tokens": 48, "temperature": 0,
                                                "json_schema": ANY_OBJECT})
        for out in outs:
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out
            assert isinstance(json.loads(out["text"]), dict) and json.loads(out["text"])

    def test_retraction_keeps_each_matcher(self, make_engine, tokenizer):
        # 24 blocks of 16 tokens for 8 requests: running ones are retracted and resume by
        # recompute; their matchers (which depend on the output tokens only) carry on.
        engine = make_engine(max_total_tokens=384, page_size=16, chunked_prefill_size=96,
                             init_new_token_ratio=0.1, min_new_token_ratio=0.05)
        ids = chat(tokenizer, "Describe a fictional employee as JSON.")
        outs = engine.generate(input_ids=[ids] * 8, sampling_params=[
            {"max_new_tokens": 120, "temperature": 1.0, "seed": s,
             "json_schema": json.dumps(EMPLOYEE)} for s in range(8)])
        assert engine.stats()["retractions"] > 0, engine.stats()
        for out in outs:
            jsonschema.validate(json.loads(out["text"]), EMPLOYEE)

    def test_compiled_once_then_cached(self, engine, tokenizer):
        schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                             "required": ["n"]})
        before = engine.stats()["grammar_compiles"]
        for _ in range(2):
            out = engine.generate(input_ids=chat(tokenizer, "A number as JSON."),
                                  sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                   "json_schema": schema})
            assert "n" in json.loads(out["text"])
        assert engine.stats()["grammar_compiles"] == before + 1


class TestOtherGrammars:
    def test_ebnf(self, engine, tokenizer):
        grammar = 'root ::= ("Yes" | "No") ", because it is " ("blue" | "grey") "."'
        outs = engine.generate(input_ids=[chat(tokenizer, "Is the sky blue?")] * 3,
                               sampling_params=[{"max_new_tokens": 16, "temperature": 1.0,
                                                 "seed": s, "ebnf": grammar} for s in range(3)])
        for out in outs:
            assert out["text"].split(", because it is ")[1] in ("blue.", "grey."), out["text"]
            assert out["text"].split(",")[0] in ("Yes", "No")
            assert out["meta_info"]["finish_reason"]["type"] == "stop"

    def test_structural_tag_constrains_only_the_tag(self, engine, tokenizer):
        compiled = engine.scheduler.grammars.compile("structural_tag", json.dumps(WEATHER_TAG))
        free, body = "Let me check. ", '<function=get_weather>{"city": "Paris"}</function>'
        state = GrammarState(compiled, ignore_eos=False)
        for token in tokenizer.encode(free, add_special_tokens=False):
            assert allowed(state, token)
            state.advance(token)
        assert allowed(state, EOS)  # free text may end here
        tokens = tokenizer.encode(body, add_special_tokens=False)
        for token in tokens:
            assert allowed(state, token), tokenizer.decode([token])
            state.advance(token)
        assert not state.broken and allowed(state, EOS)
        # Inside the tag the schema rules: a key it does not name cannot start.
        state = GrammarState(compiled, ignore_eos=False)
        for token in tokenizer.encode('<function=get_weather>{"', add_special_tokens=False):
            state.advance(token)
        assert not allowed(state, tokenizer.encode("x", add_special_tokens=False)[0])
        assert not allowed(state, EOS)
        # And through the Engine (this small model rarely calls the tool: free text).
        out = engine.generate(input_ids=chat(tokenizer, "What is the weather in Paris?"),
                              sampling_params={"max_new_tokens": 8, "temperature": 0,
                                               "structural_tag": json.dumps(WEATHER_TAG)})
        assert out["output_ids"]


class TestRefused:
    @pytest.mark.parametrize("params, field", [
        ({"json_schema": '{"type": "nonsense"}'}, "sampling_params.json_schema"),
        ({"json_schema": "{not json"}, "sampling_params.json_schema is not valid JSON"),
        ({"ebnf": 'root ::= undefined_rule'}, "sampling_params.ebnf"),
        ({"ebnf": 'root ::= ""'}, "sampling_params.ebnf admits no non-empty output"),
        ({"structural_tag": '{"type": "structural_tag"}'}, "sampling_params.structural_tag"),
        ({"structural_tag": '{"type": "structural_tag", "format": {"type": "bogus"}}'},
         "sampling_params.structural_tag"),
        ({"regex": "[0-9]+", "json_schema": ANY_OBJECT},
         "sampling_params.regex and sampling_params.json_schema"),
        ({"ebnf": 'root ::= "a"', "structural_tag": json.dumps(WEATHER_TAG)},
         "sampling_params.ebnf and sampling_params.structural_tag"),
    ])
    def test_bad_constraints_fail_before_any_work(self, engine, params, field):
        steps = engine.stats()["steps"]
        with pytest.raises(ValueError, match=field):
            engine.generate(prompt=["fine", "x"], sampling_params=[
                {"max_new_tokens": 4}, {"max_new_tokens": 4, **params}])
        assert engine.stats()["steps"] == steps  # not even the good prompt of the batch ran
        assert engine.generate(prompt="Still serving?",
                               sampling_params={"max_new_tokens": 2})["output_ids"]

    def test_beam_search_refuses_constraints(self, engine):
        from radixserve.messages import BeamParams, SamplingParams, TokenizedRequest
        from radixserve.front_door.requests import validate_request

        for field, text in (("json_schema", ANY_OBJECT), ("ebnf", 'root ::= "a"')):
            req = TokenizedRequest(rid="b", input_ids=[1, 2],
                                   sampling=SamplingParams(**{field: text}), beam=BeamParams())
            with pytest.raises(ValueError, match=f"beam search does not support "
                                                 f"sampling_params.{field}"):
                validate_request(req, engine.info, engine.config)
