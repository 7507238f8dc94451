"""Speculative decoding changes the speed, never the output: greedy output with drafts equals
greedy output without them and transformers, token for token, whatever the cache, chunking,
paging, memory pressure, stops, constraints or attention path; sampled output keeps the
model's distribution. Every engine ends with the KV-block check, so rejected drafts that
leak a block fail here."""

from __future__ import annotations

import collections
import math

import pytest

from radixserve.speculative.drafter import Drafter
from radixserve.speculative.step_cost import StepCost
from tests.conftest import checked_engine
from tests.factories import tiny_model_dir
from tests.hf_reference import HFReference, assert_matches_reference
from tests.test_engine_exact import chat

ORDERS = ("Order 1182: customer Alice Smith, address 12 Rose Street, Springfield; items: 2 blue "
          "bicycles, 1 helmet; total 540 euros. Order 1183: customer Bob Jones, address 4 Oak "
          "Avenue, Shelbyville; items: 1 red scooter; total 220 euros.")
TASKS = [
    f"Copy this text exactly, twice:\n{ORDERS}",
    "Write the numbers from 1 to 40 separated by commas.",
    f"Extract every customer name and address as JSON from: {ORDERS}",
    "Write a short poem about the sea.",  # little to copy: drafts mostly fail
]
GREEDY = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [chat(tokenizer, q) for q in TASKS]


class FreeRows(StepCost):
    """A step's cost that never prices a draft out: what the draft counts assert must not
    hang on how fast a loaded machine ran the first steps (the fit is tested on its own in
    tests/speculative/test_draft_length.py)."""

    def break_even(self, tokens: int) -> float:
        return 0.0


def spec_counts(engine) -> tuple[int, int]:
    stats = engine.stats()
    return stats["spec_draft_tokens"], stats["spec_accepted_tokens"]


@pytest.mark.parametrize("mode, config", [
    ("tree", {"chunked_prefill_size": 32, "page_size": 4}),
    ("lookup", {"enable_prefix_cache": False, "page_size": 1}),
    # A pool of about two requests' worth: retraction and eviction while drafting.
    ("lookup", {"max_total_tokens": 320, "page_size": 2, "chunked_prefill_size": 64}),
], ids=["tree_chunked", "lookup_cache_off", "lookup_short_pool"])
def test_greedy_equals_transformers(model_dir, hf, prompts, mode, config):
    with checked_engine(model_dir, speculative=mode, debug_invariants=True, **config) as engine:
        engine.scheduler.spec.cost = FreeRows()
        batch = prompts + prompts[:2]  # the repeats can draft from the first answers' KV
        results = engine.generate(input_ids=batch, sampling_params=GREEDY)
        for i, (ids, res) in enumerate(zip(batch, results)):
            assert_matches_reference(res["output_ids"], hf.greedy(ids, 48), f"{mode} #{i}")
        drafted, accepted = spec_counts(engine)
        assert accepted > 48, (drafted, accepted)  # the copy and count tasks draft well
        assert sum(r["meta_info"]["spec_accepted_tokens"] for r in results) == accepted
        if "max_total_tokens" in config:
            assert engine.stats()["retractions"] + engine.stats()["evicted_tokens"] > 0


def test_same_as_without_per_request(model_dir, prompts, tokenizer):
    """In one engine, `sampling_params.speculative` turns it on and off per request: stop
    strings and stop ids inside an accepted run end the output exactly there, logprobs of
    the kept tokens agree, a regex constraint holds, max_new_tokens cuts a run, parallel
    samples and beam search run (beams without drafts)."""
    cases = [
        dict(GREEDY, stop=["Shelbyville"]),  # in the copied text: inside a drafted run
        dict(GREEDY, stop_token_ids=[tokenizer.encode(",")[0]], max_new_tokens=40),
        dict(GREEDY, max_new_tokens=13),
        dict(GREEDY, regex=r"Order [0-9]+: customer [A-Z][a-z]+ [A-Z][a-z]+[.]"),
        dict(GREEDY, n=2),
    ]
    with checked_engine(model_dir, speculative="tree", debug_invariants=True) as engine:
        for i, params in enumerate(cases):
            prompt = prompts[1] if "stop_token_ids" in params else prompts[0]
            out = {}
            for mode in ("off", "tree"):
                out[mode] = engine.generate(
                    input_ids=prompt, sampling_params=dict(params, speculative=mode),
                    return_logprob=True, top_logprobs_num=2)
            off, on = out["off"], out["tree"]
            if isinstance(off, list):
                off, on = off[0], on[0]
            assert on["output_ids"] == off["output_ids"], f"case {i}"
            assert on["text"] == off["text"]
            assert on["meta_info"]["finish_reason"] == off["meta_info"]["finish_reason"]
            assert off["meta_info"]["spec_draft_tokens"] == 0
            lp_on = [t[0] for t in on["meta_info"]["output_token_logprobs"]]
            lp_off = [t[0] for t in off["meta_info"]["output_token_logprobs"]]
            assert len(lp_on) == len(on["output_ids"])
            assert max(abs(a - b) for a, b in zip(lp_on, lp_off)) < 1e-3, f"case {i}"
            assert len(on["meta_info"]["output_top_logprobs"]) == len(on["output_ids"])
        assert engine.stats()["spec_accepted_tokens"] > 0
        beams = engine.generate(input_ids=prompts[0], sampling_params={
            "max_new_tokens": 8, "beam_width": 2, "temperature": 0})
        assert beams["meta_info"]["spec_draft_tokens"] == 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("spec"), num_layers=2, hidden_size=64,
                          num_heads=4, num_kv_heads=2, seed=3)


@pytest.fixture(scope="module")
def tiny_hf(tiny):
    return HFReference(tiny)


@pytest.mark.parametrize("config", [
    {"attention_backend": "triton"},
    {"kv_layout": "virtual", "page_size": 8},
    {"enable_cascade_attention": True, "cascade_min_shared_tokens": 8,
     "cascade_min_group_size": 2, "cascade_cost_model": False},  # tiny: the gates decide
], ids=["triton", "virtual", "cascade"])
def test_attention_paths_on_a_tiny_model(tiny, tiny_hf, config):
    """A random model repeats itself, so it drafts and accepts a lot: the Triton kernels
    (interpreted), the virtual layout and tree attention over a shared prompt give the
    same tokens with drafts as without, and as transformers."""
    prompt = list(range(40, 80)) * 2
    batch = [prompt + [i] for i in range(3)]
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    with checked_engine(tiny, speculative="lookup", debug_invariants=True,
                        max_total_tokens=4096, **config) as engine:
        on = engine.generate(input_ids=batch, sampling_params=dict(params, speculative="lookup"))
        off = engine.generate(input_ids=batch, sampling_params=dict(params, speculative="off"))
        assert [r["output_ids"] for r in on] == [r["output_ids"] for r in off]
        assert engine.stats()["spec_accepted_tokens"] > 0
    for i, (ids, res) in enumerate(zip(batch, on)):
        assert_matches_reference(res["output_ids"], tiny_hf.greedy(ids, 16), f"tiny #{i}")


class FixedDraft(Drafter):
    """Drafts one given token as a sequence's second, whatever the context, the acceptance
    or the step's cost. Only there: a prompt whose last chunk is one token is verified
    like a decode, and a draft there would make a sequence's count depend on how the
    step's budget happened to split its prompt."""

    def __init__(self, token: int) -> None:
        super().__init__("lookup", 1, None)
        self.token = token

    def propose(self, req, most: int, break_even: float) -> list[int]:
        second = len(req.output_ids) == 1
        return [self.token] if second and most > 0 and self._drafts(req) is not None else []


def test_sampling_keeps_the_model_distribution(tiny):
    """Over many seeds, the second sampled token is distributed as without drafts when a
    draft proposes the commonest second token (accepted often, rejected often): a
    two-sample chi-square test at the 0.1% level."""
    prompt = list(range(40, 60)) * 3
    params = {"temperature": 4.0, "top_k": 5, "max_new_tokens": 3, "ignore_eos": True}
    seeds = range(600)
    with checked_engine(tiny, speculative="lookup", max_total_tokens=8192) as engine:
        def second_tokens(mode: str) -> collections.Counter:
            res = engine.generate(input_ids=[prompt] * len(seeds), sampling_params=[
                dict(params, seed=s, speculative=mode) for s in seeds])
            return collections.Counter(r["output_ids"][1] for r in res)

        off = second_tokens("off")
        engine.scheduler.spec.drafter = FixedDraft(off.most_common(1)[0][0])
        on = second_tokens("lookup")
        drafted, accepted = spec_counts(engine)
    assert drafted == len(seeds), (drafted, accepted, off)
    assert 0.1 * drafted < accepted < 0.9 * drafted, (drafted, accepted, off)
    cells = [(off[t], on[t]) for t in set(off) | set(on)]
    chi2 = sum((a - b) ** 2 / (a + b) for a, b in cells if a + b)  # equal sample sizes
    dof = len(cells) - 1
    assert dof >= 2, cells
    # Wilson-Hilferty: the chi-square quantile at 1 - 0.001 (z = 3.09).
    critical = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < critical, (chi2, critical, cells)
