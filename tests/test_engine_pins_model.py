"""A pinned prefix with the default model: the pin's own prefill (a max_new_tokens=0
request) leaves KV that answers exactly as a cold prefill does, greedy, token for token."""

from __future__ import annotations

GREEDY = {"max_new_tokens": 8, "temperature": 0}
SYSTEM = ("You are a helpful assistant who answers questions about the solar system in "
          "one short sentence. ")


def test_pinned_prefill_answers_as_a_cold_prefill(engine) -> None:
    prompt = SYSTEM + "Which planet is the largest?"
    engine.flush_cache()
    cold = engine.generate(prompt, GREEDY)
    assert cold["meta_info"]["cached_tokens"] == 0
    assert engine.flush_cache()
    pin = engine.pin_prefix(SYSTEM)  # nothing cached: the pin prefills it
    warm = engine.generate(prompt, GREEDY)
    assert warm["meta_info"]["cached_tokens"] == pin["tokens"] > 0
    assert warm["output_ids"] == cold["output_ids"]
    assert engine.unpin_prefix(SYSTEM)["unpinned"]
