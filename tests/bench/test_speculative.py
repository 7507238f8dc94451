"""bench/speculative.py's harness and its chat workloads: deterministic requests of the
promised shapes, and one row driven on the default model with speculation off."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import pytest

from bench import speculative
from bench.chat_workloads import CHAT_WORKLOADS, make_chat_workload, split_history
from bench.concurrency import closed_loop
from bench.workloads import IM_END
from tests.bench.test_harness import fake_encode


@pytest.mark.parametrize("name", CHAT_WORKLOADS)
def test_chat_workloads_are_deterministic_from_the_seed(name: str) -> None:
    a = make_chat_workload(name, "quick", fake_encode, 8, seed=3)
    b = make_chat_workload(name, "quick", fake_encode, 8, seed=3)
    c = make_chat_workload(name, "quick", fake_encode, 8, seed=4)
    assert a.requests == b.requests
    assert [r.segment for r in a.requests] != [r.segment for r in c.requests]
    assert len(speculative.conversations(split_history(a)[1])) == 8


def test_repeated_questions_were_all_asked_before() -> None:
    w = make_chat_workload("repeated_question", "quick", fake_encode, 8)
    history, timed = split_history(w)
    asked = [r.segment for r in history.requests]
    prompts = [r.segment for r in timed.requests]
    assert len(set(asked)) == len(asked) == 4 and timed.num_requests == 8
    assert Counter(prompts) == {p: w.settings["repeats"] for p in asked}
    first_repeat = next(i for i, p in enumerate(prompts) if p in prompts[:i])
    assert first_repeat == len(asked), "every question asked again once before any twice"
    assert split_history(make_chat_workload("control", "quick", fake_encode, 8))[0] is None


def test_control_shares_and_repeats_nothing() -> None:
    w = make_chat_workload("control", "quick", fake_encode, 64)
    assert len({r.segment for r in w.requests}) == 64
    assert all(r.parent is None for r in w.requests)


def test_agent_turns_quote_tool_results_in_json() -> None:
    w = make_chat_workload("agent", "tiny", fake_encode, 2)
    follow_ups = [r for r in w.requests if r.parent is not None]
    assert follow_ups and all(r.segment[:1] == tuple(fake_encode(IM_END)) for r in follow_ups)


def test_mismatches_names_where_outputs_diverge() -> None:
    got = speculative.mismatches({"a": [1, 2, 3], "b": [1, 2], "c": [5]},
                                 {"a": [1, 2, 3], "b": [1, 2, 4], "c": [6]})
    assert got == {"count": 2, "requests": 3, "first_diverging": {"b": 2, "c": 0}}


def test_turns_carry_the_models_output(make_engine, tokenizer) -> None:
    """A follow-up turn's prompt is its parent's prompt, the parent's output without its
    end of turn (the segment writes it), and the segment."""
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    w = make_chat_workload("agent", "tiny", encode, 1)
    run = speculative.ModeRun(make_engine(), w, encode(IM_END))
    closed_loop(run.conversation, speculative.conversations(w), 1)
    for req in w.requests:
        assert len(run.outputs[req.rid]) <= req.output_tokens
        if req.parent is not None:
            assert run.prompts[req.rid] == (run.prompts[req.parent] + run.history[req.parent]
                                            + list(req.segment))
    assert sum(r.cached_tokens for r in run.records) > 0, "later turns reuse earlier prompts"


def test_one_row_with_speculation_off(make_engine, tokenizer) -> None:
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    w = make_chat_workload("control", "tiny", encode, 2)
    row = speculative.run_row({"off": make_engine()}, w, batch=2, rounds=1,
                              end_of_turn=encode(IM_END))
    off = row["modes"]["off"]
    assert off["output_tokens"] == w.num_requests * w.settings["output_tokens"]
    assert off["ratio"] == 1.0 and off["mismatches"]["count"] == 0
    report = {"preset": "tiny", "machine": {"commit": "c", "radixserve_commit": "c", "cpu": "x",
                                            "cores": 2, "torch_threads": 2,
                                            "loadavg_at_start": (0.0, 0.0, 0.0), "torch": "t"},
              "limits": {"matmul_gflops": 1.0, "read_gbs": 1.0},
              "settings": {"model": "m", "modes": ["off"], "num_draft_tokens": 4, "rounds": 1},
              "workload_settings": {"control": dict(w.settings)}, "rows": [row],
              "targets": speculative.targets([row])}
    assert "| control | 2 | 2 | off | " in speculative.markdown(report)
    json.dumps(report)


def test_closed_loop_keeps_batch_in_flight_and_raises_errors() -> None:
    lock, state = threading.Lock(), {"now": 0, "most": 0}

    def work(item: int) -> None:
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        time.sleep(0.01)
        with lock:
            state["now"] -= 1
        if item == 7:
            raise ValueError("item 7")

    closed_loop(work, list(range(7)), 3)
    assert state["most"] == 3
    with pytest.raises(ValueError, match="item 7"):
        closed_loop(work, list(range(12)), 3)
