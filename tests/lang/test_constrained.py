"""regex= and dtype= constrain sampled output: 50 runs at temperature 1, every one matches."""

from __future__ import annotations

import re

import radixserve.lang as sgl

PROMPT = "The train left the station at 7 and reached the city"


def test_regex_outputs_always_match(backend):
    pattern = r"(early|late|on time) by [0-9]{1,2} (minutes|hours)"

    # The longest match has 21 characters and every token adds at least one, so 24 tokens
    # always suffice, even when sampling picks a character-by-character spelling.
    @sgl.function
    def when(s, i):
        s += f"{PROMPT} (trip {i}):" + sgl.gen("when", regex=pattern, max_tokens=24)

    states = when.run_batch([{"i": i} for i in range(50)], temperature=1.0)
    outs = [s["when"] for s in states]
    assert all(re.fullmatch(pattern, o) for o in outs), outs
    assert len(set(outs)) > 1  # sampled, not a constant


def test_int_outputs_always_parse(backend):
    @sgl.function
    def count(s, i):
        s += f"Trip {i}. {PROMPT}. The number of passengers was " + sgl.gen(
            "n", dtype=int, max_tokens=6)

    states = count.run_batch([{"i": i} for i in range(50)], temperature=1.0)
    outs = [s["n"] for s in states]
    assert all(re.fullmatch(r"[-+]?[0-9]+", o) for o in outs), outs
    assert all(isinstance(int(o), int) for o in outs)


def test_bool_and_gen_int(backend):
    @sgl.function
    def facts(s):
        s += "Is the sky blue? " + sgl.gen("b", dtype=bool, max_tokens=3)
        s += "\nHow many legs has a cat? " + sgl.gen_int("legs", max_tokens=4)

    state = facts.run(temperature=0)
    assert state["b"] in ("True", "False")
    assert re.fullmatch(r"[0-9]+", state["legs"])
