"""The demo: a batch of chat requests sharing a system prompt, through the RPC server (the
README's main job) or an in-process Engine."""

from __future__ import annotations

import time
from typing import Any, Callable

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


def run_demo(tokenizer: Any, generate: Callable[..., Any],
             stats: Callable[[], dict], max_new_tokens: int = 40) -> None:
    """Send the demo batch with `generate(prompt=..., sampling_params=...)` (an Engine's or
    a client's: a list of prompts gets a list of results) and print the answers, each
    request's cached tokens and the cache hit rate."""
    prompts = [tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}],
        tokenize=False, add_generation_prompt=True) for q in QUESTIONS]
    started = time.perf_counter()
    results = generate(prompt=prompts,
                       sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0})
    elapsed = time.perf_counter() - started
    for question, result in zip(QUESTIONS, results):
        meta = result["meta_info"]
        print(f"\nQ: {question}\nA: {result['text'].strip()}\n   [prompt {meta['prompt_tokens']} "
              f"tokens, cached {meta['cached_tokens']}, generated {meta['completion_tokens']}]")
    generated = sum(r["meta_info"]["completion_tokens"] for r in results)
    print(f"\n{len(results)} requests in {elapsed:.1f}s ({generated / elapsed:.1f} output "
          f"tokens/s); cache hit rate {stats()['cache_hit_rate']:.0%} of prompt tokens", flush=True)


def in_process(max_new_tokens: int = 40, **config: Any) -> None:
    from radixserve.engine import Engine

    started = time.perf_counter()
    with Engine(**config) as engine:
        info = engine.info
        print(f"loaded {engine.model_dir.name} on {info.device} ({info.dtype}) in "
              f"{time.perf_counter() - started:.1f}s; KV pool {info.num_blocks} blocks x "
              f"{info.page_size} tokens ({info.kv_pool_bytes / 2**20:.0f} MiB)")
        run_demo(engine.tokenizer, engine.generate, engine.stats, max_new_tokens)


def against_server(address: str, model: str) -> None:
    """Run from the server once it is ready: the demo batch through the RPC client."""
    from radixserve.client import Client
    from radixserve.model.loader import load_tokenizer, resolve_model

    with Client(address) as client:
        run_demo(load_tokenizer(resolve_model(model)), client.generate, client.stats)
    print(f"\nserving at {address}; Ctrl-C to stop", flush=True)
