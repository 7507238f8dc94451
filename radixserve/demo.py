"""The main job until the server lands: a batch of chat requests sharing a system prompt."""

from __future__ import annotations

import time

from radixserve.engine import Engine

SYSTEM_PROMPT = (
    "You are Atlas, the help desk assistant of the Northwind public library. The library is "
    "open Monday to Friday from 9 am to 8 pm and on Saturday from 10 am to 4 pm; it is closed "
    "on Sunday. Members may borrow up to 12 items at once for three weeks, renewable twice "
    "online unless someone else has reserved the item. Late returns cost 20 cents a day per "
    "item. The library card is free for residents and costs 15 dollars a year for others. "
    "There are study rooms on the second floor that can be booked for two hours a day, and "
    "a makerspace with 3D printers that needs a short safety course first. Answer in one or "
    "two short sentences, politely, using only these facts."
)
QUESTIONS = [
    "When is the library open on Saturday?",
    "How many books can I borrow at once?",
    "What does a late return cost?",
    "Is the library card free?",
    "Can I book a study room?",
    "How do I use the 3D printers?",
]


def main(model: str | None = None, max_new_tokens: int = 40, **config) -> None:
    started = time.perf_counter()
    engine = Engine(model, **config)
    print(f"loaded {engine.model_dir.name} on {engine.info.device} ({engine.info.dtype}) in "
          f"{time.perf_counter() - started:.1f}s; KV pool {engine.info.num_blocks} blocks x "
          f"{engine.info.page_size} tokens ({engine.info.kv_pool_bytes / 2**20:.0f} MiB)")
    prompts = [engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}],
        tokenize=False, add_generation_prompt=True) for q in QUESTIONS]
    params = {"max_new_tokens": max_new_tokens, "temperature": 0}
    started = time.perf_counter()
    results = engine.generate(prompt=prompts, sampling_params=params)
    elapsed = time.perf_counter() - started
    for question, result in zip(QUESTIONS, results):
        meta = result["meta_info"]
        print(f"\nQ: {question}\nA: {result['text'].strip()}\n   [prompt {meta['prompt_tokens']} "
              f"tokens, cached {meta['cached_tokens']}, generated {meta['completion_tokens']}]")
    stats = engine.stats()
    generated = sum(r["meta_info"]["completion_tokens"] for r in results)
    print(f"\n{len(results)} requests in {elapsed:.1f}s ({generated / elapsed:.1f} output tokens/s); "
          f"cache hit rate {stats['cache_hit_rate']:.0%} of prompt tokens")
    engine.shutdown()
