"""A few-shot classifier: every question shares the same examples, and `select` scores
each label by the model's token logprobs. The shared examples are prefilled once; every
other request reads them from the radix cache.

    python examples/few_shot_select.py                  # in-process Engine
    python examples/few_shot_select.py --server tcp://127.0.0.1:30001
"""

from __future__ import annotations

import time

import radixserve.lang as sgl
from _common import backend_from_args, report

EXAMPLES = [
    ("The battery died after two days and support never answered.", "negative"),
    ("Setup took a minute and it has worked perfectly since.", "positive"),
    ("It does what the box says, nothing more.", "neutral"),
    ("Best purchase I made this year, my kids love it.", "positive"),
    ("The screen cracked the first week and the refund took a month.", "negative"),
    ("Arrived on Tuesday as promised.", "neutral"),
]
REVIEWS = [
    "Absolutely wonderful, I would buy it again.", "Broke on day one. Avoid.",
    "It is a phone case.", "The sound is rich and the bass is deep.",
    "Customer service hung up on me twice.", "Delivered in a brown box.",
    "Stopped charging after a week.", "My favourite gadget by far.",
]


@sgl.function
def classify(s, review):
    s += "Classify the sentiment of each review as positive, negative or neutral.\n\n"
    for text, label in EXAMPLES:
        s += f"Review: {text}\nSentiment: {label}\n\n"
    s += f"Review: {review}\nSentiment:"
    s += sgl.select("label", choices=[" positive", " negative", " neutral"])


def main() -> None:
    backend, _ = backend_from_args(__doc__)
    start = time.perf_counter()
    states = classify.run_batch([{"review": r} for r in REVIEWS], progress_bar=True)
    for review, state in zip(REVIEWS, states):
        scores = state.get_meta_info("label")["scores"]
        print(f"{state['label']:>9}  {review}   scores={[round(x, 2) for x in scores]}")
    print(f"{len(REVIEWS)} reviews in {time.perf_counter() - start:.1f}s")
    report(backend)
    backend.shutdown()


if __name__ == "__main__":
    main()
