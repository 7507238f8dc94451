"""Greedy output equals transformers token for token, whatever the cache, chunking, paging,
batch mix or memory pressure."""

from __future__ import annotations

import pytest

from tests.hf_reference import assert_matches_reference

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "Who wrote Romeo and Juliet?",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Name a famous painting by Leonardo da Vinci.",
    "Why is the sky blue? Answer briefly, in simple words a child would understand.",
    "Give me a synonym for happy.",
    "What year did the first person walk on the Moon, and who was it?",
    "Describe a cat in five words.",
    "Hi",
    "Summarise the plot of Cinderella in two sentences, then give its moral.",
    "What is the boiling point of water at sea level in Fahrenheit and in Celsius?",
]
SYSTEM = (
    "You are a meticulous assistant for a company that sells bicycles, spare parts and "
    "repair services in three cities. Always greet the customer, answer precisely, and never "
    "invent prices. The shop opens at eight in the morning and closes at six in the evening "
    "on weekdays; on Saturdays it closes at two. Repairs take two working days unless the "
    "part must be ordered, which adds a week. Electric bicycles carry a two-year warranty on "
    "the battery and five years on the frame. Customers can rent a bicycle for a day, a "
    "week or a month; helmets are included for free. Deliveries within the city are free "
    "for orders above one hundred euros. Returns are accepted within thirty days with the "
    "receipt. Students get ten percent off on accessories with a valid card. The company "
    "also runs free maintenance workshops on the first Sunday of every month, where people "
    "learn to fix a flat tire, adjust brakes and oil a chain. "
) * 2


def chat(tokenizer, question: str, system: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text)


def check_greedy(engine, hf, prompts: list[list[int]], max_new_tokens: int, what: str):
    results = engine.generate(input_ids=prompts, sampling_params={
        "max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True})
    for i, (ids, res) in enumerate(zip(prompts, results)):
        assert res["meta_info"]["prompt_tokens"] == len(ids)
        assert_matches_reference(res["output_ids"], hf.greedy(ids, max_new_tokens), f"{what} #{i}")
    return results


class TestAgainstTransformers:
    def test_one_prompt(self, engine, hf, tokenizer):
        ids = chat(tokenizer, QUESTIONS[0])
        res = engine.generate(input_ids=ids,
                              sampling_params={"max_new_tokens": 24, "temperature": 0})
        ref = hf.greedy(ids, 24, eos=set(engine.scheduler.eos_ids))
        assert_matches_reference(res["output_ids"], ref, "one prompt")
        assert res["text"] == tokenizer.decode(res["output_ids"], skip_special_tokens=True)
        assert res["meta_info"]["completion_tokens"] == len(res["output_ids"])

    def test_batch_of_16_mixed_lengths(self, engine, hf, tokenizer):
        prompts = [chat(tokenizer, q) for q in QUESTIONS]
        prompts[3] = tokenizer.encode("Once upon a time")  # a short plain-text prompt too
        check_greedy(engine, hf, prompts, 12, "batch")

    @pytest.mark.parametrize("cache, policy", [(True, "lpm"), (True, "fcfs"), (False, "lpm")],
                             ids=["cache_on_lpm", "cache_on_fcfs", "cache_off"])
    def test_shared_system_prompt(self, make_engine, hf, tokenizer, cache, policy):
        engine = make_engine(enable_prefix_cache=cache, schedule_policy=policy)
        prompts = [chat(tokenizer, q, SYSTEM) for q in QUESTIONS[:8]]
        assert len(prompts[0]) > 300
        results = check_greedy(engine, hf, prompts, 8, f"shared prefix, cache={cache}")
        cached = [r["meta_info"]["cached_tokens"] for r in results]
        if cache:
            # The first computes the system prompt; the others find it in the tree.
            assert sum(c >= 256 for c in cached) >= 7, cached
            assert engine.stats()["cache_hit_rate"] > 0.6
        else:
            assert cached == [0] * 8


class TestChunkingAndPaging:
    @pytest.mark.parametrize("page_size", [1, 16])
    @pytest.mark.parametrize("chunk", [1, 7, 64])
    def test_chunk_and_page_sizes(self, make_engine, hf, tokenizer, chunk, page_size):
        engine = make_engine(chunked_prefill_size=chunk, page_size=page_size)
        base = chat(tokenizer, QUESTIONS[9])
        prompts = [base, base[:-3] + chat(tokenizer, "Thanks!")[-6:], tokenizer.encode("1, 2, 3,")]
        check_greedy(engine, hf, prompts, 6, f"chunk={chunk} page={page_size}")
        # Again, now with the prefixes cached: the hits must not change a token.
        results = check_greedy(engine, hf, prompts, 6, f"cached, chunk={chunk} page={page_size}")
        assert results[0]["meta_info"]["cached_tokens"] > 0


class TestMemoryPressure:
    def test_eviction_and_retraction_stay_exact(self, make_engine, hf, tokenizer):
        # 24 blocks of 16 tokens: a few requests fill it, so running ones must be retracted
        # and cached prefixes evicted, while every answer stays exact.
        engine = make_engine(max_total_tokens=384, page_size=16, chunked_prefill_size=96,
                             init_new_token_ratio=0.1, min_new_token_ratio=0.05)
        prompts = [chat(tokenizer, q) for q in QUESTIONS[:10]]
        # 20 new tokens each already retract a few and evict; each one more is a
        # transformers step per prompt.
        check_greedy(engine, hf, prompts, 20, "under memory pressure")
        stats = engine.stats()
        assert stats["retractions"] > 0, stats
        assert stats["evicted_tokens"] > 0, stats
