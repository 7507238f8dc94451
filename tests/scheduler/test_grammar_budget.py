"""A grammar's matcher works on credit in the scheduler's loop (issue 53, finding 3): an
ambiguous grammar, whose every token costs more than the last, ends its output with an
abort naming the bound long before a token costs seconds; an ordinary constraint, or a
single slow token, never does."""

from __future__ import annotations

import json
import time

import pytest

from radixserve.model.loader import load_tokenizer
from radixserve.scheduler.grammar import GRAMMAR_STEP_SECONDS, GrammarState
from radixserve.scheduler.grammar_compiler import GrammarCompiler
from tests.factories import tiny_model_dir

AMBIGUOUS = ['root ::= x\nx ::= x x | "a" | "b" | "c"',
             'root ::= y\ny ::= y y y | y y | "ab" | "a" | "b"']


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    model = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")
    tokenizer = load_tokenizer(model)
    compiler = GrammarCompiler(model, len(tokenizer), [tokenizer.eos_token_id])
    yield compiler, tokenizer
    compiler.close()


@pytest.mark.parametrize("grammar", AMBIGUOUS)
@pytest.mark.parametrize("samples", [1, 4])
def test_an_ambiguous_grammar_ends_its_output_at_its_budget(compiler, grammar, samples):
    compiled, tokenizer = compiler
    state = GrammarState(compiled.compile("ebnf", grammar), ignore_eos=True, samples=samples)
    a = tokenizer.convert_tokens_to_ids("a")
    followed = 0
    while state.over_budget is None and followed < 400:
        state.advance(a)
        followed += 1
    assert state.over_budget is not None, followed  # ended, long before 400 tokens
    assert "sampling_params.ebnf" in state.over_budget and "budget" in state.over_budget


def test_an_ordinary_constraint_and_a_pause_never_spend_the_credit(compiler):
    compiled, tokenizer = compiler
    schema = json.dumps({"type": "object", "properties": {"items": {
        "type": "array", "items": {"type": "integer"}}}, "required": ["items"]})
    state = GrammarState(compiled.compile("json_schema", schema), ignore_eos=True, samples=8)
    text = '{"items": [' + ", ".join(str(i) for i in range(300)) + "]}"
    fill = state._fill

    def paused() -> None:  # the whole process paused once, mid-token (a collection)
        time.sleep(5 * GRAMMAR_STEP_SECONDS / 8)
        fill()

    for i, token in enumerate(tokenizer.encode(text, add_special_tokens=False)):
        state._fill = paused if i == 50 else fill  # type: ignore[method-assign]
        state.advance(token)
        assert state.over_budget is None and not state.broken, i
    assert state.accepted
