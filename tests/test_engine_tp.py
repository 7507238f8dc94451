"""Tensor parallelism (`tp_size`): every family's sharded model gives transformers' greedy
tokens and logprobs, with KV heads split (N = 2) and replicated (N = 4 > 2 KV heads), through
chunked prefill, eviction, the prefix cache off, forks, beams, tree attention, speculative
decoding, the virtual layout, the Triton kernels, the disk tier (each rank its own files) and warm
restarts; the default model at N = 3 (9 query heads, 3 KV heads), also in 4 bits; the group opens no
port beyond loopback; and shapes that do not divide are refused before anything loads."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from radixserve import Engine
from tests.conftest import assert_blocks_accounted, checked_engine
from tests.factories import tiny_model_dir
from tests.hf_reference import HFReference, assert_matches_reference
from tests.test_engine_exact import QUESTIONS, SYSTEM, chat

LOGPROB_TOL = 1e-4
SHAPE = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128)
FAMILIES = {
    "llama": dict(family="llama"),
    "qwen2": dict(family="qwen2"),
    "qwen3": dict(family="qwen3", head_dim=32, tie_word_embeddings=False),
    "mistral": dict(family="mistral", sliding_window=32),
}
BASE = list(range(1000, 1060))
PROMPTS = [BASE[:40], BASE, [7, 8, 9] + BASE[3:50], BASE[:40] + [5, 6]]
"""Shared prefixes (40 tokens: several pages), one unrelated prompt, past the window."""
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
_refs: dict[Path, HFReference] = {}


def reference(model_dir: Path) -> HFReference:
    if model_dir not in _refs:
        _refs[model_dir] = HFReference(model_dir)
    return _refs[model_dir]


def family_dir(tmp_path_factory, name: str) -> Path:
    return tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models",
                          **{**SHAPE, **FAMILIES[name]})


def assert_logprobs(res: dict, ids: list[int], ref: HFReference) -> None:
    """Every prompt and output token's logprob within LOGPROB_TOL of transformers'."""
    full = ids + res["output_ids"]
    lp = ref.logprobs(full)
    meta = res["meta_info"]
    for pos, (value, token, _) in enumerate(meta["input_token_logprobs"][1:], start=1):
        assert abs(value - float(lp[pos - 1, token])) < LOGPROB_TOL, (pos, value)
    for k, (value, token, _) in enumerate(meta["output_token_logprobs"]):
        assert abs(value - float(lp[len(ids) + k - 1, token])) < LOGPROB_TOL, (k, value)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_sharded_equals_transformers(tmp_path_factory, name, tp):
    """Small pages and chunks, a pool that evicts: the shared prefixes are cached, evicted
    and read again on every rank alike."""
    model_dir = family_dir(tmp_path_factory, name)
    ref = reference(model_dir)
    with checked_engine(model_dir, tp_size=tp, page_size=4, chunked_prefill_size=16,
                        max_total_tokens=160, debug_invariants=True) as engine:
        assert engine.model_info()["tp_size"] == tp
        results = [engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True,
                                   logprob_start_len=0) for ids in PROMPTS]
        for i, (ids, res) in enumerate(zip(PROMPTS, results)):
            assert_matches_reference(res["output_ids"], ref.greedy(ids, 10), f"{name} #{i}")
            assert_logprobs(res, ids, ref)
        batch = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [r["output_ids"] for r in batch] == [r["output_ids"] for r in results]
        assert engine.stats()["evicted_tokens"] > 0


@pytest.mark.parametrize("config", [
    {"enable_prefix_cache": False},
    {"kv_layout": "virtual", "page_size": 16},
    {"attention_backend": "triton"},
    {"enable_cascade_attention": True, "cascade_min_shared_tokens": 8,
     "cascade_min_group_size": 2},
    {"speculative": "lookup"},
], ids=["nocache", "virtual", "triton", "cascade", "speculative"])
def test_attention_paths_per_rank(tmp_path_factory, config):
    """Each rank runs the configured KV layout and kernels on its own heads; drafts are
    verified on the gathered logits."""
    model_dir = family_dir(tmp_path_factory, "llama")
    ref = reference(model_dir)
    with checked_engine(model_dir, tp_size=2, max_total_tokens=2048, debug_invariants=True,
                        **config) as engine:
        out = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        for i, (ids, res) in enumerate(zip(PROMPTS, out)):
            assert_matches_reference(res["output_ids"], ref.greedy(ids, 10), f"#{i}")
        if "speculative" in config:
            assert engine.stats()["spec_accepted_tokens"] > 0


def test_the_disk_tier_per_rank_and_a_warm_restart(tmp_path_factory, tmp_path):
    """A pool of 8 blocks: each prompt evicts the others' prefixes to disk, each rank
    writing its heads' share to its own directory; they come back exactly, and a restart on
    the same directory (the same group size) answers from disk."""
    model_dir = family_dir(tmp_path_factory, "qwen2")
    ref = reference(model_dir)
    prompts = [[i] * 3 + BASE[i:i + 40] for i in range(3)]
    options = dict(tp_size=2, page_size=8, max_total_tokens=64, kv_disk_dir=str(tmp_path),
                   debug_invariants=True)
    with Engine(str(model_dir), **options) as engine:  # closed unflushed: the cache stays
        for ids in prompts + prompts:
            assert_matches_reference(engine.generate(input_ids=ids, sampling_params=GREEDY)[
                "output_ids"], ref.greedy(ids, 10), "disk")
        assert engine.stats()["disk_loads"] > 0
        assert_blocks_accounted(engine, flush=False)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["rank0", "rank1"]
    with checked_engine(model_dir, **options) as engine:
        res = engine.generate(input_ids=prompts[0], sampling_params=GREEDY)
        assert res["meta_info"]["cached_tokens_details"]["disk"] > 0, res["meta_info"]
        assert_matches_reference(res["output_ids"], ref.greedy(prompts[0], 10), "warm")


def listening(pids: set[int]) -> list[str]:
    """The TCP addresses `pids` listen on (from /proc: LISTEN sockets they hold)."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}") if os.path.exists(
                f"/proc/{pid}/fd/{fd}") else ""
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                found.append(fields[1])
    return found


LOOPBACK = ("0100007F:", "00000000000000000000000001000000:")


def test_the_group_listens_on_loopback_only(tmp_path_factory):
    import psutil

    model_dir = family_dir(tmp_path_factory, "llama")
    with checked_engine(model_dir, tp_size=2, max_total_tokens=1024) as engine:
        me = psutil.Process()
        pids = {me.pid, *(c.pid for c in me.children(recursive=True))}
        addresses = listening(pids)
        assert addresses, "the ranks' gloo connections listen somewhere"
        assert all(a.startswith(LOOPBACK) for a in addresses), addresses
        engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)


def test_a_step_that_fails_on_rank_0_alone_breaks_the_group_without_a_hang(tmp_path_factory):
    """The other ranks may be waiting in a collective rank 0 never reaches: every later
    call is answered at once with why, and shutdown does not wait for them."""
    model_dir = family_dir(tmp_path_factory, "llama")
    engine = Engine(str(model_dir), tp_size=2, max_total_tokens=1024)
    try:
        def boom(*args):
            raise ValueError("injected")

        metadata, engine.worker._metadata = engine.worker._metadata, boom
        params = dict(GREEDY, max_new_tokens=3)
        first = engine.generate(input_ids=PROMPTS[0], sampling_params=params)["meta_info"]
        assert "injected" in first["finish_reason"]["message"]
        engine.worker._metadata = metadata
        later = engine.generate(input_ids=PROMPTS[0], sampling_params=params)["meta_info"]
        assert "out of step" in later["finish_reason"]["message"]
    finally:
        start = time.monotonic()
        engine.shutdown()
        assert time.monotonic() - start < 5


@pytest.fixture(scope="module")
def tp3(model_dir):
    """The default model over 3 ranks: 3 query heads and one KV head each."""
    with checked_engine(model_dir, tp_size=3, max_total_tokens=4096,
                        debug_invariants=True) as engine:
        yield engine


class TestDefaultModelOverThreeRanks:
    def test_greedy_and_logprobs_equal_transformers(self, tp3, hf, tokenizer):
        prompts = [chat(tokenizer, q, system=SYSTEM) for q in QUESTIONS[:3]]
        out = tp3.generate(input_ids=prompts, sampling_params=dict(GREEDY, max_new_tokens=12),
                           return_logprob=True, logprob_start_len=0)
        for i, (ids, res) in enumerate(zip(prompts, out)):
            assert_matches_reference(res["output_ids"], hf.greedy(ids, 12), f"#{i}")
            assert_logprobs(res, ids, hf)

    def test_forks_and_beams(self, tp3, hf, tokenizer):
        ids = tokenizer.encode("The capital of France is")
        forks = tp3.generate(input_ids=ids, sampling_params=dict(GREEDY, n=3))
        want = hf.greedy(ids, 10)
        for fork in forks:
            assert_matches_reference(fork["output_ids"], want, "fork")
        beams = tp3.beam_search(input_ids=ids, beam_width=2, max_new_tokens=8)
        expected = hf.beam_search(ids, 2, 8)
        assert [b["output_ids"] for b in beams] == [tokens for tokens, _ in expected]
        for b, (_, score) in zip(beams, expected):
            assert b["meta_info"]["beam_score"] == pytest.approx(score, abs=1e-4)


def test_q4_over_three_ranks_equals_one(model_dir, tokenizer):
    """The default model's GGUF 4-bit groups and Q8_0 head, cut per rank, compute what one
    rank does (the same weights; only the all-reduce's order of sums differs)."""
    prompts = [chat(tokenizer, QUESTIONS[0])]
    outputs = []
    for tp in (1, 3):
        with checked_engine("smollm2-135m", quantization="q4", tp_size=tp,
                            max_total_tokens=2048) as engine:
            outputs.append([r["output_ids"] for r in engine.generate(
                input_ids=prompts, sampling_params=GREEDY)])
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("shape, tp, dimension", [
    (dict(num_heads=4, num_kv_heads=2), 3, "num_attention_heads"),
    (dict(num_heads=6, num_kv_heads=3, hidden_size=96), 2, "num_key_value_heads"),
    (dict(intermediate_size=130), 4, "intermediate_size"),
])
def test_a_dimension_that_does_not_divide_is_named(tmp_path_factory, shape, tp, dimension):
    model_dir = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models",
                               **{**SHAPE, **shape})
    with pytest.raises(ValueError, match=dimension):
        Engine(str(model_dir), tp_size=tp)


def test_a_quantized_split_that_cuts_a_group_is_refused(tmp_path_factory):
    model_dir = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models", **SHAPE)
    with pytest.raises(ValueError, match="row-parallel"):  # o_proj: 64 inputs / 4 ranks
        Engine(str(model_dir), tp_size=4, quantization="int8")


def test_options_are_checked():
    with pytest.raises(ValueError, match="dist_init_addr"):
        Engine(nnodes=2, tp_size=2)
    with pytest.raises(ValueError, match="node_rank"):
        Engine(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="127.0.0.1:1234")
    with pytest.raises(ValueError, match="tp_size"):
        Engine(tp_size=3, nnodes=2, dist_init_addr="127.0.0.1:1234")
