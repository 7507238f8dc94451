"""run_batch: 16 programs sharing a few-shot prefix meet in one continuous batch and read
the prefix from the radix cache; a program that raises keeps its error to itself."""

from __future__ import annotations

import radixserve.lang as sgl

FEW_SHOT = "".join(
    f"Question: {q}\nTopic: {t}\n\n" for q, t in [
        ("Who painted the Mona Lisa and in which century did the painter live?", "art"),
        ("What is the boiling point of water at sea level, in degrees Celsius?", "science"),
        ("Which team won the football world cup held in Brazil in 2014?", "sport"),
        ("How many strings does a standard classical guitar have?", "music"),
        ("What is the chemical symbol of gold on the periodic table?", "science"),
        ("Who wrote the novel Pride and Prejudice, published in 1813?", "literature"),
        ("Which sculptor made the statue of David in Florence?", "art"),
        ("How long is a marathon race, in kilometres, rounded to one decimal?", "sport"),
        ("Which composer wrote the Four Seasons violin concertos?", "music"),
        ("Who wrote the epic poem the Odyssey, according to tradition?", "literature"),
    ])
TOPICS = [" art", " science", " sport", " music", " literature"]
QUESTIONS = [
    "Who painted Starry Night?", "What is the speed of light?", "Who won Wimbledon in 2019?",
    "Who composed the Magic Flute?", "Who wrote Hamlet?", "What is a black hole?",
    "How many players are on a rugby team?", "Who painted Guernica?", "What is DNA?",
    "Who wrote War and Peace?", "What is a sonata?", "Which planet is largest?",
    "Who sculpted The Thinker?", "How long is a tennis set?", "Who wrote Ulysses?",
    "What instrument did Miles Davis play?",
]


@sgl.function
def topic(s, question):
    if question is None:
        raise ValueError("no question given")
    s += FEW_SHOT + "Question: " + question + "\nTopic:"
    s += sgl.select("topic", choices=TOPICS)


def test_shared_prefix_batch_hits_the_cache(fresh):
    states = topic.run_batch([{"question": q} for q in QUESTIONS], progress_bar=True)
    assert [s.error() for s in states] == [None] * 16
    assert all(s["topic"] in TOPICS for s in states)
    stats = fresh.stats()
    assert stats["cache_hit_rate"] > 0.80, stats
    # one raising program: the other 15 results are the same as before
    batch = [{"question": q} for q in QUESTIONS]
    batch[5] = {"question": None}
    again = topic.run_batch(batch, num_threads=16)
    assert isinstance(again[5].error(), ValueError)
    for i, (before, after) in enumerate(zip(states, again)):
        if i != 5:
            assert after.error() is None and after["topic"] == before["topic"]


def test_failing_call_is_kept_in_the_state(backend):
    @sgl.function
    def bad(s):
        s += "Hello" + sgl.gen("x", max_tokens=4, top_p=5.0)  # rejected by the runtime
        s += " world"

    state = bad.run()
    assert isinstance(state.error(), ValueError)
    assert "top_p" in str(state.error())
    try:
        state["x"]
    except sgl.ProgramError as e:
        assert isinstance(e.__cause__, ValueError)
    else:
        raise AssertionError("reading a variable of a failed program must raise")
    assert state.text() == "Hello"  # nothing after the failure ran
