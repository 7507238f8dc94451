"""radixserve.scheduler.beam against transformers' own beam search.

Both sides see the same log-probabilities: a `LogitsProcessor` that replaces the model's
scores with a scripted float32 log_softmax row, a pure function of the whole sequence (prompt
+ generated), drives transformers' `generate(num_beams=k)` on a tiny random Llama; our side
asks the same function for each of its beams. So decisions and scores must agree exactly, and
the scripts can make EOS likely, tie two tokens, or shrink the vocabulary below
`candidates_per_beam`. One test also uses the model's real logits (a cache-less forward on our
side), as the engine will.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from radixserve.scheduler.beam import BeamCandidates, BeamHypothesis, BeamSearch

transformers = pytest.importorskip("transformers")
from transformers import (GenerationConfig, LlamaConfig, LlamaForCausalLM,  # noqa: E402
                          LogitsProcessor, LogitsProcessorList)

transformers.logging.set_verbosity_error()

VOCAB = 64
PAD = VOCAB - 1
PROMPT = [5, 17, 42, 9]


def tiny_llama(vocab: int, seed: int = 0, init: float = 0.02) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      initializer_range=init, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama(VOCAB)


class Script(LogitsProcessor):
    """Scripted log-probabilities: row(seq) = log_softmax(randn(V) * scale + bias), seeded by
    the sequence. `alias` {b: a} gives token b exactly a's logit, and makes b and a the same
    token for seeding, so that which of the two a tie-break picks changes no later score."""

    def __init__(self, vocab: int = VOCAB, seed: int = 0, scale: float = 2.0,
                 bias: dict[int, float] | None = None, alias: dict[int, int] | None = None) -> None:
        self.vocab, self.seed, self.scale = vocab, seed, scale
        self.bias, self.alias = bias or {}, alias or {}
        self._memo: dict[tuple[int, ...], torch.Tensor] = {}

    def canon(self, seq) -> tuple[int, ...]:
        return tuple(self.alias.get(int(t), int(t)) for t in seq)

    def row(self, seq) -> torch.Tensor:
        key = self.canon(seq)
        r = self._memo.get(key)
        if r is None:
            g = torch.Generator().manual_seed(zlib.crc32(repr((self.seed, key)).encode()))
            logits = torch.randn(self.vocab, generator=g, dtype=torch.float32) * self.scale
            for t, b in self.bias.items():
                logits[t] += b
            for b, a in self.alias.items():
                logits[b] = logits[a]
            r = self._memo[key] = torch.log_softmax(logits, dim=-1)
        return r

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return torch.stack([self.row(s) for s in input_ids.tolist()]).to(scores.dtype)


def hf_generate(model, script: Script, k: int, n: int, lp: float, es, eos: list[int],
                prompt=PROMPT):
    gc = GenerationConfig(
        num_beams=k, do_sample=False, num_return_sequences=k, max_new_tokens=n,
        eos_token_id=eos or None, pad_token_id=PAD, length_penalty=lp, early_stopping=es,
        output_scores=True, return_dict_in_generate=True, repetition_penalty=1.0,
        no_repeat_ngram_size=0, temperature=None, top_k=None, top_p=None)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc,
                             logits_processor=LogitsProcessorList([script]))
    # Nothing but the script touched the scores (no default processors before or after it).
    assert torch.equal(out.scores[0][0], script.row(prompt))
    return out


def hf_beams(model, script, k, n, lp, es, eos, prompt=PROMPT) -> list[tuple[list[int], float]]:
    out = hf_generate(model, script, k, n, lp, es, eos, prompt)
    lens = (out.beam_indices != -1).sum(dim=1).tolist()
    p = len(prompt)
    return [(out.sequences[i, p:p + lens[i]].tolist(), float(out.sequences_scores[i]))
            for i in range(k)]


def run_ours(script: Script, k: int, n: int, lp: float, es, eos, prompt=PROMPT,
             n_cand: int | None = None) -> tuple[list[BeamHypothesis], int]:
    bs = BeamSearch(k, n, length_penalty=lp, early_stopping=es, eos_ids=frozenset(eos))
    n_cand = min(n_cand or bs.candidates_per_beam, script.vocab)
    steps = 0
    while True:
        cands = []
        for gen in bs.running:
            lp_row = script.row(list(prompt) + list(gen))
            vals, idx = torch.topk(lp_row, n_cand)
            cands.append(BeamCandidates(idx.tolist(), vals.tolist()))
        st = bs.step(cands)
        steps += 1
        if st.done:
            break
        assert len(st.parents) == len(st.tokens) == len(st.scores) == k
        assert st.scores == sorted(st.scores, reverse=True)
    assert steps <= n
    return bs.finish(), steps


def assert_same(ours: list[BeamHypothesis], theirs: list[tuple[list[int], float]], lp: float,
                canon=None, tol: float = 0.0) -> None:
    """Same hypotheses in the same order; scores equal (bit for bit by default: with the same
    float32 logprobs our float32-rounded arithmetic is HF's)."""
    canon = canon or (lambda s: tuple(s))
    assert len(ours) == len(theirs)
    for h, (ids, score) in zip(ours, theirs):
        assert canon(h.output_ids) == canon(ids), (ours, theirs)
        assert abs(h.score - score) <= tol, (h, score)
    for h in ours:  # the bookkeeping behind each score
        assert h.score == pytest.approx(h.cum_logprob / len(h.output_ids) ** lp, rel=1e-6, abs=1e-6)


# -- 1. property-style: transformers' _beam_search vs ours ----------------------------------------

EOS1 = [3]
CASES = [
    # (eos ids, bias on them): EOS unlikely / likely / very likely / two EOS ids / ignore_eos
    ([3], {}),
    ([3], {3: 3.0}),
    ([3, 11], {3: 2.5, 11: 2.0}),
    ([], {3: 3.0}),
]


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("lp", [1.0, 0.0, 2.0, -0.5])
@pytest.mark.parametrize("es", [False, True, "never"])
def test_matches_transformers(model, k, lp, es):
    for (eos, bias), seed in itertools.product(CASES, [0, 1]):
        script = Script(seed=seed, bias=bias)
        n = 7
        ours, _ = run_ours(script, k, n, lp, es, eos)
        assert_same(ours, hf_beams(model, script, k, n, lp, es, eos), lp)
        for h in ours:
            assert (h.finish_reason == "length") == (len(h.output_ids) == n)
            if h.finish_reason == "stop":
                assert h.matched == h.output_ids[-1] and h.matched in eos
            assert not set(h.output_ids[:-1]) & set(eos)


@pytest.mark.parametrize("lp", [1.0, 0.0, 2.0, -0.5])
@pytest.mark.parametrize("es", [False, True, "never"])
def test_width_one_is_greedy(model, lp, es):
    """generate(num_beams=1) is greedy search; BeamSearch(1) gives the same tokens and the
    summed logprob, whatever the length penalty and early stopping."""
    for (eos, bias), seed in itertools.product(CASES, [0, 1, 2]):
        script = Script(seed=seed, bias=bias)
        n = 7
        (hyp,), _ = run_ours(script, 1, n, lp, es, eos)
        out = hf_generate(model, script, 1, n, lp, es, eos)
        greedy = out.sequences[0, len(PROMPT):].tolist()
        assert hyp.output_ids == greedy
        cum = torch.zeros((), dtype=torch.float32)
        for t, tok in enumerate(greedy):
            cum += out.scores[t][0, tok]
        assert hyp.cum_logprob == pytest.approx(float(cum), abs=1e-5)
        assert hyp.score == pytest.approx(hyp.cum_logprob / len(greedy) ** lp, abs=1e-5)


def test_real_model_logits():
    """The engine's way: our beams' logprobs from a cache-less forward of the same model that
    transformers runs with its KV cache (no script). The two forwards differ by ~1e-6 per
    logprob, which a length penalty of -0.5 multiplies by sqrt(6): scores within 1e-4."""
    model = tiny_llama(VOCAB, seed=1, init=0.5)
    eos = [int(torch.log_softmax(model(torch.tensor([PROMPT])).logits[0, -1], -1).argsort()[-3])]
    configs = [(2, 1.0, False), (4, 1.0, False), (4, 2.0, "never"), (3, -0.5, True),
               (4, 0.0, False)]
    for k, lp, es in configs:
        gc = GenerationConfig(num_beams=k, do_sample=False, num_return_sequences=k,
                              max_new_tokens=6, eos_token_id=eos, pad_token_id=PAD,
                              length_penalty=lp, early_stopping=es, output_scores=True,
                              return_dict_in_generate=True)
        ids = torch.tensor([PROMPT])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
            lens = (out.beam_indices != -1).sum(dim=1).tolist()
            theirs = [(out.sequences[i, len(PROMPT):len(PROMPT) + lens[i]].tolist(),
                       float(out.sequences_scores[i])) for i in range(k)]
            bs = BeamSearch(k, 6, lp, es, eos)
            while True:
                cands = []
                for gen in bs.running:
                    logits = model(torch.tensor([PROMPT + list(gen)])).logits[0, -1].float()
                    row = torch.log_softmax(logits, -1)
                    vals, idx = torch.topk(row, bs.candidates_per_beam)
                    cands.append(BeamCandidates(idx.tolist(), vals.tolist()))
                if bs.step(cands).done:
                    break
        assert_same(bs.finish(), theirs, lp, tol=1e-4)


# -- 2. edge cases ---------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 4])
def test_max_new_tokens_one(model, k):
    script = Script(seed=3, bias={3: 2.0})
    ours, steps = run_ours(script, k, 1, 1.0, False, EOS1)
    assert steps == 1 and len(ours) == k
    assert all(len(h.output_ids) == 1 and h.finish_reason == "length" for h in ours)
    # the k best first tokens, EOS among them, best first
    top = torch.topk(script.row(PROMPT), k)
    assert [h.output_ids[0] for h in ours] == top.indices.tolist()
    if k > 1:
        assert_same(ours, hf_beams(model, script, k, 1, 1.0, False, EOS1), 1.0)


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("es", [False, True, "never"])
def test_all_beams_hit_eos_early(model, k, es):
    """EOS overwhelmingly likely: every beam finishes within a few tokens and the search stops
    long before max_new_tokens, except with early_stopping="never" and a positive length
    penalty, whose bound assumes a running beam could reach max_new_tokens."""
    for lp in (1.0, 0.0, -0.5, 2.0):
        script = Script(seed=4, bias={3: 8.0})
        n = 20
        ours, steps = run_ours(script, k, n, lp, es, EOS1)
        if es == "never" and lp > 0:
            assert steps > 10
        else:
            assert steps <= 3
            assert all(h.finish_reason == "stop" and h.matched == 3 for h in ours)
        assert_same(ours, hf_beams(model, script, k, n, lp, es, EOS1), lp)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_eos_is_the_first_best_token(model, k):
    script = Script(seed=5)
    row = script.row(PROMPT)
    eos = [int(row.argmax())]
    ours, _ = run_ours(script, k, 6, 1.0, False, eos)
    assert ours[0].output_ids == eos and ours[0].matched == eos[0]
    assert ours[0].score == pytest.approx(float(row[eos[0]]))
    if k == 1:  # greedy stops there
        assert len(ours) == 1
    else:  # the other beams ran on from the other tokens and never start with EOS
        assert_same(ours, hf_beams(model, script, k, 6, 1.0, False, eos), 1.0)
        assert all(h.output_ids[0] != eos[0] for h in ours[1:])


@pytest.mark.parametrize("k", [2, 4])
def test_exact_ties(model, k):
    """Token 21 always has exactly token 8's logprob. torch.topk orders equal values any way,
    so only the scores and the sequences up to 21 == 8 can match."""
    script = Script(seed=6, scale=0.5, alias={21: 8}, bias={8: 2.0, 3: 1.0})
    ours, _ = run_ours(script, k, 6, 1.0, False, EOS1)
    assert any(8 in h.output_ids for h in ours)
    assert_same(ours, hf_beams(model, script, k, 6, 1.0, False, EOS1), 1.0, canon=script.canon)


@pytest.mark.parametrize("k,vocab", [(4, 6), (4, 3), (2, 3)])
def test_vocab_smaller_than_candidates(k, vocab):
    """Fewer tokens than candidates_per_beam: HF's -1e9 prompt copies then run as beams too;
    they (and anything they produce) score about -1e9, and tie among themselves in ways torch
    leaves open, so compare the real hypotheses only."""
    model = tiny_llama(vocab)
    script = Script(vocab=vocab, seed=7)
    prompt = [1, 2, 0]
    for eos in ([0], []):
        ours, _ = run_ours(script, k, 4, 1.0, False, eos, prompt=prompt)
        out = hf_generate(model, script, k, 4, 1.0, False, eos, prompt=prompt)
        lens = (out.beam_indices != -1).sum(dim=1).tolist()
        theirs = [(out.sequences[i, 3:3 + lens[i]].tolist(), float(out.sequences_scores[i]))
                  for i in range(k) if out.sequences_scores[i] > -1e8]
        assert_same([h for h in ours if h.score > -1e8], theirs, 1.0)
        assert len(ours) == k  # the garbage ones are returned too, as HF does


def test_first_step_starts_from_one_beam():
    bs = BeamSearch(3, 5, eos_ids={0})
    assert bs.candidates_per_beam == 6
    assert BeamSearch(3, 5, eos_ids={0, 1, 2}).candidates_per_beam == 12
    assert BeamSearch(3, 5).candidates_per_beam == 6
    st = bs.step([BeamCandidates([0, 4, 5, 6, 7, 8], [-0.1, -0.5, -1.0, -2.0, -3.0, -4.0])])
    # EOS ranked first: a finished hypothesis, not a running beam; the next three run
    assert st.parents == [0, 0, 0] and st.tokens == [4, 5, 6] and not st.done
    assert [h.output_ids for h in bs.finish()] == [[0]]
    with pytest.raises(ValueError):
        bs.step([BeamCandidates([1], [-1.0])])  # one list for three beams


def test_invalid_arguments():
    for kw in ({"beam_width": 0}, {"max_new_tokens": 0}, {"early_stopping": "always"},
               {"early_stopping": 1}, {"length_penalty": float("nan")}):
        args = {"beam_width": 2, "max_new_tokens": 3} | kw
        with pytest.raises(ValueError):
            BeamSearch(**args)
    bs = BeamSearch(2, 1)
    assert bs.step([BeamCandidates([1, 2, 3, 4], [-1.0, -2.0, -3.0, -4.0])]).done
    with pytest.raises(RuntimeError):
        bs.step([BeamCandidates([1], [-1.0])] * 2)
