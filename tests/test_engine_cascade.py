"""Tree attention end to end: greedy output equals transformers token for token while
decodes (and prefill chunks) read their shared prefixes once per group, on a shared system
prompt, a two-level tree of prompts, a DSL fork, `n` = 4 and under memory pressure."""

from __future__ import annotations

import pytest

import radixserve.lang as sgl
import radixserve.worker.worker as worker_module
from radixserve.worker.cascade import CascadePlan
from radixserve.worker.cascade_cost import CascadeCost
from tests.hf_reference import assert_matches_reference
from tests.test_engine_exact import QUESTIONS, SYSTEM, chat, check_greedy

FEW_SHOT = [
    "Q: Is a tomato a fruit?\nA: Yes, botanically it is a fruit.\nQ: Is a whale a fish?\n"
    "A: No, a whale is a mammal.\nQ: Do penguins fly?\nA: No, they swim instead.\n",
    "Example: 'The cat sat.' -> subject: cat, verb: sat.\nExample: 'Birds sing.' -> subject: "
    "birds, verb: sing.\nExample: 'The old man walked home.' -> subject: man, verb: walked.\n",
    "Translate to French. English: good night -> French: bonne nuit. English: thank you -> "
    "French: merci. English: see you tomorrow -> French: a demain. English: the red house -> "
    "French: la maison rouge.\n",
]


# Gates low enough for this file's short prompts (the defaults are tuned for speed), and
# they alone deciding: the cost model would rightly keep runs this short on the plain path.
GATES = dict(cascade_min_shared_tokens=64, cascade_min_group_size=2, cascade_cost_model=False)


@pytest.fixture
def plans(monkeypatch) -> list[CascadePlan]:
    """Every cascade plan the worker makes while the test runs."""
    seen: list[CascadePlan] = []
    plan = worker_module.plan_cascade

    def spy(*args, **kwargs):
        result = plan(*args, **kwargs)
        if result is not None:
            seen.append(result)
        return result

    monkeypatch.setattr(worker_module, "plan_cascade", spy)
    return seen


def deepest(plans: list[CascadePlan]) -> int:
    return max((len(p.levels) for p in plans), default=0)


def test_the_costs_are_measured_at_start_up_never_in_a_request(make_engine, hf, tokenizer,
                                                               monkeypatch):
    measured: list[CascadeCost] = []
    measure = CascadeCost.measure

    def spy(*args, **kwargs):
        measured.append(measure(*args, **kwargs))
        return measured[-1]

    monkeypatch.setattr(CascadeCost, "measure", spy)
    engine = make_engine(**{**GATES, "cascade_cost_model": True})
    assert len(measured) == 1
    prompts = [chat(tokenizer, q, SYSTEM) for q in QUESTIONS[:8]]
    # Whatever the verdict, the output is transformers' and nothing more is measured.
    check_greedy(engine, hf, prompts, 8, "one system prompt, the cost model on")
    assert len(measured) == 1


class TestCascadeAgainstTransformers:
    def test_eight_requests_on_one_system_prompt(self, make_engine, hf, tokenizer, plans):
        engine = make_engine(**GATES)
        prompts = [chat(tokenizer, q, SYSTEM) for q in QUESTIONS[:8]]
        # 8 new tokens: test_engine_exact's shared-prefix case, whose transformers
        # reference (memoised for the session) this reuses.
        check_greedy(engine, hf, prompts, 8, "one system prompt")
        stats = engine.stats()
        assert stats["cascade_steps"] > 0, stats
        # All eight decoding over the one prompt, read once for the group.
        assert any(len(run.seqs) == 8 for p in plans for run in p.levels[0])

    def test_two_level_tree(self, make_engine, hf, tokenizer, plans):
        # One system prompt -> three few-shot sets -> three questions each.
        engine = make_engine(**{**GATES, "cascade_min_shared_tokens": 32})
        prompts = [chat(tokenizer, shots + q, SYSTEM[:700])
                   for shots in FEW_SHOT for q in QUESTIONS[:3]]
        check_greedy(engine, hf, prompts, 6, "two-level tree")
        assert deepest(plans) >= 2, [[len(level) for level in p.levels] for p in plans]
        assert any(len(p.levels) >= 2 and len(p.levels[1]) == 3 for p in plans)

    def test_parallel_samples(self, make_engine, hf, tokenizer, plans):
        engine = make_engine(**GATES)
        ids = chat(tokenizer, QUESTIONS[9], SYSTEM)
        results = engine.generate(input_ids=ids, sampling_params={
            "max_new_tokens": 10, "temperature": 0, "ignore_eos": True, "n": 4})
        ref = hf.greedy(ids, 10)
        assert len(results) == 4
        for i, res in enumerate(results):
            assert_matches_reference(res["output_ids"], ref, f"sample {i}")
        assert any(len(run.seqs) == 4 for p in plans for run in p.levels[0])
        # Seeded samples are the same tokens with the cascade on and off.
        sampled = {"max_new_tokens": 10, "temperature": 0.8, "seed": 5, "n": 4}
        on = [r["output_ids"] for r in engine.generate(input_ids=ids, sampling_params=sampled)]
        off_engine = make_engine(enable_cascade_attention=False)
        off = [r["output_ids"] for r in off_engine.generate(input_ids=ids, sampling_params=sampled)]
        assert on == off

    def test_memory_pressure(self, make_engine, hf, tokenizer, plans):
        # 28 blocks of 16: the system prompt plus eight requests' own pages for 20 new
        # tokens do not fit, so requests are retracted and cached pages evicted while
        # groups keep forming.
        engine = make_engine(**GATES, max_total_tokens=448, chunked_prefill_size=128,
                             init_new_token_ratio=0.1, min_new_token_ratio=0.05)
        prompts = [chat(tokenizer, q, SYSTEM[:900]) for q in QUESTIONS[:8]]
        check_greedy(engine, hf, prompts, 20, "cascade under memory pressure")
        stats = engine.stats()
        assert stats["retractions"] > 0 and stats["evicted_tokens"] > 0, stats
        assert stats["cascade_steps"] > 0, stats

    def test_dsl_fork(self, make_engine, hf, tokenizer, plans):
        engine = make_engine(**GATES)

        @sgl.function
        def forked(s, questions):
            s += sgl.system(SYSTEM)
            branches = s.fork(len(questions))
            for branch, q in zip(branches, questions):
                branch += sgl.user(q) + sgl.assistant_begin()
            s["prompts"] = [branch.text() for branch in branches]
            for branch in branches:  # the four gens run concurrently, one thread each
                branch += sgl.gen("answer", max_tokens=10, temperature=0) + sgl.assistant_end()
            branches.join()

        state = forked.run(questions=QUESTIONS[:4], backend=sgl.EngineBackend(engine))
        assert state.error() is None
        eos = set(engine.scheduler.eos_ids)
        for prompt, answer in zip(state["prompts"], state["answer"]):
            ids = tokenizer.encode(prompt)
            ref = hf.greedy(ids, 10, eos=eos)
            assert answer == tokenizer.decode(ref.tokens, skip_special_tokens=True), prompt[-60:]
        assert any(len(run.seqs) == 4 for p in plans for run in p.levels[0])
