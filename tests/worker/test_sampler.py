"""The sampler on synthetic logits: filters restrict the support, draws follow the
distribution, seeds reproduce, penalties follow their definitions."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest
import torch

from tests.worker.host_syncs import HostSyncs, mixed_params
from radixserve.messages import LogitBias, SeqSampling
from radixserve.messages.sampling import is_greedy
from radixserve.worker import top_p
from radixserve.worker.sampler import Sampler, SamplingTensors, apply_penalties

PROBS = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
LOGITS = PROBS.log()


def params(step: int = 0, seed: int = 0, **kw) -> SeqSampling:
    base = dict(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, seed=seed, step=step)
    return SeqSampling(**{**base, **kw})


def draw(n: int = 4000, **kw) -> torch.Tensor:
    sampler = Sampler()
    logits = LOGITS.repeat(n, 1)
    return sampler(logits, [params(step=i, **kw) for i in range(n)])


class TestSampler:
    def test_follows_the_distribution(self):
        freq = torch.bincount(draw(), minlength=5).float() / 4000
        assert torch.allclose(freq, PROBS, atol=0.03), freq

    def test_top_k_top_p_min_p_restrict_the_support(self):
        assert set(draw(top_k=2).tolist()) == {0, 1}
        assert set(draw(top_p=0.6).tolist()) == {0, 1}   # mass before token 1 is 0.4 < 0.6
        assert set(draw(min_p=0.3).tolist()) == {0, 1, 2}  # >= 0.3 * 0.4
        freq = torch.bincount(draw(top_k=2), minlength=5).float() / 4000
        assert abs(freq[0] - 0.4 / 0.7) < 0.03

    def test_banned_ids_are_never_picked(self):
        """min_new_tokens: EOS and the stop tokens, greedy or sampled."""
        assert set(draw(temperature=0.0, banned_ids=[0]).tolist()) == {1}
        assert set(draw(banned_ids=[0, 2]).tolist()) == {1, 3, 4}

    def test_greedy_and_temperature(self):
        assert set(draw(temperature=0.0).tolist()) == {0}
        cold = torch.bincount(draw(temperature=0.2), minlength=5).float() / 4000
        assert cold[0] > 0.75

    def test_seed_and_step_reproduce(self):
        a = Sampler()(LOGITS.repeat(3, 1), [params(seed=5, step=s) for s in (0, 1, 2)])
        b = Sampler()(LOGITS.repeat(1, 1), [params(seed=5, step=1)])
        assert a[1] == b[0]
        many = draw(n=200, seed=1)
        assert torch.equal(many, draw(n=200, seed=1))
        assert not torch.equal(many, draw(n=200, seed=2))


class TestPenalties:
    def test_frequency_presence_repetition(self):
        logits = torch.tensor([[2.0, 1.0, -1.0, 0.5]])
        p = params(frequency_penalty=0.5, presence_penalty=0.25, output_ids=[1, 1, 2])
        apply_penalties(logits, SamplingTensors.of([p], logits.device))
        want = torch.tensor([[2.0, 1.0 - 1.0 - 0.25, -1.0 - 0.5 - 0.25, 0.5]])
        assert torch.allclose(logits, want)
        logits = torch.tensor([[2.0, 1.0, -1.0, 0.5]])
        p = params(repetition_penalty=2.0, prompt_ids=[0], output_ids=[2])
        apply_penalties(logits, SamplingTensors.of([p], logits.device))
        assert torch.allclose(logits, torch.tensor([[1.0, 1.0, -2.0, 0.5]]))


class TestRegexMask:
    @staticmethod
    def mask(allowed: list[int], vocab: int = 5) -> bytes:
        import numpy as np
        bits = np.zeros(8 * -(-vocab // 8), dtype=bool)
        bits[allowed] = True
        return np.packbits(bits, bitorder="little").tobytes()

    def test_mask_restricts_greedy_and_sampled_rows(self):
        from radixserve.worker.sampler import apply_masks
        logits = LOGITS.repeat(2, 1)
        apply_masks(logits, [params(allowed_mask=self.mask([2, 4])), params()])
        assert torch.isinf(logits[0, [0, 1, 3]]).all() and torch.isfinite(logits[0, [2, 4]]).all()
        assert torch.equal(logits[1], LOGITS)
        # greedy: the best allowed token, not the best token
        assert draw(n=50, temperature=0.0, allowed_mask=self.mask([3, 4])).tolist() == [3] * 50
        sampled = draw(allowed_mask=self.mask([1, 3]))
        assert set(sampled.tolist()) == {1, 3}
        freq = torch.bincount(sampled, minlength=5).float() / 4000
        assert abs(freq[1] - 0.3 / 0.4) < 0.03  # renormalised over the allowed tokens
        # the logits the caller passed (used for output logprobs) are left untouched
        logits = LOGITS.repeat(1, 1)
        Sampler()(logits, [params(allowed_mask=self.mask([4]))])
        assert torch.equal(logits[0], LOGITS)

    def test_min_new_tokens_yields_to_a_constraint_that_can_only_stop(self):
        # A grammar whose output is complete allows only EOS; min_new_tokens bans EOS. The
        # row must still get a token (the constraint's), not a batch-wide failure.
        tokens = draw(n=3, temperature=0.0, allowed_mask=self.mask([4]), banned_ids=[4])
        assert tokens.tolist() == [4, 4, 4]
        assert draw(n=3, temperature=0.0, allowed_mask=self.mask([3, 4]),
                    banned_ids=[4]).tolist() == [3, 3, 3]


class TestLogitBias:
    def test_bias_is_added_per_row_greedy_rows_too(self):
        from radixserve.worker.sampler import apply_logit_bias
        logits = LOGITS.repeat(3, 1)
        apply_logit_bias(logits, [params(logit_bias=LogitBias.of({"0": -100.0, "3": 2.5})),
                                  params(), params(logit_bias=LogitBias.of({"1": 1.0}))])
        want = LOGITS.repeat(3, 1)
        want[0, 0] -= 100.0
        want[0, 3] += 2.5
        want[2, 1] += 1.0
        assert torch.allclose(logits, want)
        # -100 takes greedy's token away; +100 all but forces one
        banned = LogitBias.of({"0": -100.0})
        assert draw(n=20, temperature=0.0, logit_bias=banned).tolist() == [1] * 20
        assert set(draw(n=500, logit_bias=LogitBias.of({"4": 100.0})).tolist()) == {4}
        # bias and mask together: the mask still wins
        mask = TestRegexMask.mask([2, 3])
        assert draw(n=20, temperature=0.0, logit_bias=LogitBias.of({"2": -100.0}),
                    allowed_mask=mask).tolist() == [3] * 20

    def test_caller_logits_untouched(self):
        logits = LOGITS.repeat(1, 1)
        Sampler()(logits, [params(temperature=0.0, logit_bias=LogitBias.of({"0": -100.0}))])
        assert torch.equal(logits[0], LOGITS)


class TestVerify:
    """Speculative decoding's verification (`Sampler.verify`): rows after 0, 1, ... draft
    tokens; what it keeps is what decoding without the draft would give."""

    def test_greedy_keeps_the_draft_while_it_is_the_argmax(self):
        rows = torch.tensor([[0.0, 5, 1, 0, 0], [0, 0, 5, 1, 0], [0, 0, 0, 0, 5]])
        sampler = Sampler()
        assert sampler.verify(rows, [params(temperature=0.0, draft=[1, 2])]) == [[1, 2, 4]]
        assert sampler.verify(rows, [params(temperature=0.0, draft=[1, 3])]) == [[1, 2]]
        assert sampler.verify(rows, [params(temperature=0.0, draft=[0, 2])]) == [[1]]
        # Two sequences in one call, the second's rows after the first's.
        both = torch.cat([rows[:2], rows])
        assert sampler.verify(both, [params(temperature=0.0, draft=[4]),
                                     params(temperature=0.0, draft=[1, 2])]) == [[1], [1, 2, 4]]

    def test_masks_and_penalties_follow_the_draft(self):
        """Row i's penalties count the draft's first i tokens; a constrained request's row i
        takes the i-th draft mask."""
        rows = torch.tensor([[0.0, 5, 4, 0, 0], [0, 5, 4, 0, 0]])
        repeat = params(temperature=0.0, draft=[1], output_ids=[], presence_penalty=2.0)
        assert Sampler().verify(rows, [repeat]) == [[1, 2]]  # row 1 penalises token 1
        mask_only_3 = bytes([0b1000])
        masked = params(temperature=0.0, draft=[1], allowed_mask=bytes([0b11111]),
                        draft_masks=[mask_only_3])
        assert Sampler().verify(rows, [masked]) == [[1, 3]]

    def test_sampled_tokens_keep_the_distribution(self):
        """With a draft of token 2 (p = 0.15) or token 0 (p = 0.4), the first token over
        many seeds is distributed as PROBS (chi-square, 4 degrees of freedom, 0.1% level:
        18.47); the acceptance rate is p(draft)."""
        n = 6000
        for drafted in (2, 0):
            rows = LOGITS.repeat(2 * n, 1)
            kept = Sampler().verify(rows, [params(seed=s, draft=[drafted]) for s in range(n)])
            first = torch.tensor([k[0] for k in kept])
            counts = torch.bincount(first, minlength=5).double()
            chi2 = float(((counts - n * PROBS.double()) ** 2 / (n * PROBS.double())).sum())
            assert chi2 < 18.47, (drafted, counts)
            accepted = sum(len(k) == 2 for k in kept) / n
            assert abs(accepted - float(PROBS[drafted])) < 0.02, accepted


class TestOnTheDevice:
    """A step reads nothing back from the device but its results: one copy of the sampled
    ids (and of the logprobs asked for), at any batch size and mix of parameters."""

    @pytest.fixture(autouse=True)
    def gpu_top_p(self, monkeypatch):
        """Top-p as on a GPU: on the CPU it reads which rows its head does not cover (free
        there, `worker/top_p.py`), which these counts would take for a GPU's sync."""
        monkeypatch.setattr(top_p, "HEAD_DEVICES", frozenset())

    def test_a_step_syncs_once_whatever_the_batch(self):
        counts = []
        for batch in (4, 64):
            logits = torch.randn(batch, 300, generator=torch.Generator().manual_seed(batch))
            params_ = mixed_params(batch, 300)
            assert {is_greedy(p.temperature, p.top_k) for p in params_} == {True, False}
            with HostSyncs() as syncs:
                Sampler()(logits, params_).tolist()
            counts.append(syncs.seen)
        assert counts == [["tolist"], ["tolist"]]

    def test_a_plain_greedy_step_is_one_argmax(self, monkeypatch):
        """Greedy rows with nothing that changes their logits pack no parameters for the
        device; a penalty, a bias or a mask on one of them does."""
        logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(0))
        greedy = [params(temperature=0.0, seed=i) for i in range(8)]
        packed = []
        real = SamplingTensors.of.__func__

        def of(cls, rows, device):
            packed.append(len(rows))
            return real(cls, rows, device)

        monkeypatch.setattr(SamplingTensors, "of", classmethod(of))
        assert torch.equal(Sampler()(logits, greedy), logits.argmax(-1)) and not packed
        for changed in (dict(repetition_penalty=100.0, output_ids=[int(logits[0].argmax())]),
                        dict(banned_ids=[int(logits[0].argmax())]),
                        dict(logit_bias=LogitBias.of({"7": 100.0}))):
            rows = [msgspec.structs.replace(greedy[0], **changed), *greedy[1:]]
            tokens = Sampler()(logits, rows)
            assert tokens[0] != logits[0].argmax() and torch.equal(tokens[1:],
                                                                   logits[1:].argmax(-1))
        assert packed == [8, 8, 8]

    def test_verification_syncs_once_whatever_the_batch(self):
        for batch in (2, 24):
            seqs = [msgspec.structs.replace(p, draft=[3, 1, 4][:1 + i % 3])
                    for i, p in enumerate(mixed_params(batch, 300))]
            rows = sum(len(p.draft) + 1 for p in seqs)
            logits = torch.randn(rows, 300, generator=torch.Generator().manual_seed(batch))
            with HostSyncs() as syncs:
                Sampler().verify(logits, seqs)
            assert syncs.seen == ["tolist"]

    def test_logprobs_add_one_copy_each(self):
        """The sampled tokens' logprobs and the top ones: two copies for the whole step."""
        from radixserve.messages import ForwardBatch, SeqLogprobs
        from radixserve.worker.logits import read_logits, sample_logits
        for batch in (4, 64):
            asked = [SeqLogprobs(input_targets=[], input_start=0, output=True, top_n=i % 3)
                     if i % 2 else None for i in range(batch)]
            params = list(mixed_params(batch, 300))
            step = SimpleNamespace(batch=ForwardBatch(
                seqs=list(range(batch)), input_ids=[0] * batch, q_lens=[1] * batch,
                kv_lens=[5] * batch, logprobs=asked), sample=params)
            logits = torch.randn(batch, 300, generator=torch.Generator().manual_seed(batch))
            with HostSyncs() as syncs:
                plan = sample_logits(step, logits, Sampler())  # type: ignore[arg-type]
                outputs = read_logits(step.batch, plan, Sampler())
            assert syncs.seen == ["tolist"] * 3
            tokens = Sampler()(logits, params)
            full = torch.log_softmax(logits, dim=-1)
            for i, out in enumerate(outputs):
                assert out.next_token == tokens[i]
                if asked[i] is None:
                    assert out.output_logprob is None and out.output_top is None
                    continue
                assert out.output_logprob == pytest.approx(float(full[i, tokens[i]]))
                top_n = asked[i].top_n
                assert (out.output_top is None) == (top_n == 0)
                if top_n:
                    assert out.output_top.token_ids == full[i].topk(top_n).indices.tolist()


class TestSeededDeterminism:
    """A seeded row's token is a function of its own logits, parameters, seed and step:
    the same alone, in any batch, in any order (so after a retraction too)."""

    KINDS = [dict(), dict(top_k=7), dict(top_p=0.8), dict(min_p=0.1, temperature=0.6),
             dict(top_k=20, top_p=0.9, min_p=0.05, temperature=1.3),
             dict(frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.3,
                  output_ids=[1, 2, 2, 5], prompt_ids=[7, 9])]

    def test_alone_or_in_any_batch(self):
        gen = torch.Generator().manual_seed(0)
        rows = torch.randn(len(self.KINDS), 500, generator=gen) * 2
        mine = [params(seed=100 + i, step=3 + i, **kind) for i, kind in enumerate(self.KINDS)]
        alone = [int(Sampler()(rows[i:i + 1], [p])[0]) for i, p in enumerate(mine)]
        others = [params(temperature=0.0), params(top_p=0.5, seed=9),
                  params(top_k=300, seed=8), params(banned_ids=[0, 1], seed=7),
                  params(logit_bias=LogitBias.of({"4": 3.0}), seed=6)]
        for trial in range(4):
            order = torch.randperm(len(mine) + len(others), generator=gen).tolist()
            batch = [(mine + others)[j] for j in order]
            logits = torch.cat([rows, torch.randn(len(others), 500, generator=gen)])[order]
            tokens = Sampler()(logits, batch).tolist()
            assert [tokens[order.index(i)] for i in range(len(mine))] == alone, trial

    def test_a_verified_draft_keeps_its_tokens_in_any_batch(self):
        gen = torch.Generator().manual_seed(1)
        seq = params(seed=42, step=5, top_p=0.9, draft=[3, 8])
        rows = torch.randn(3, 50, generator=gen)
        rows[0, 3] = rows[1, 8] = 4.0  # likely drafts
        [alone] = Sampler().verify(rows, [seq])
        other = params(temperature=0.0, draft=[1])
        both = torch.cat([torch.randn(2, 50, generator=gen), rows])
        assert Sampler().verify(both, [other, seq])[1] == alone
        assert Sampler().verify(torch.cat([rows, rows]), [seq, seq]) == [alone, alone]

    def test_the_rng_is_splitmix64_exactly(self):
        """Wrapping int64 arithmetic on the device equals the unbounded reference, so a
        seed gives the same draws on every device and platform."""
        from radixserve.worker.sampler import _uniform

        def mix(z: int) -> int:
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2 ** 64
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2 ** 64
            return z ^ (z >> 31)

        def reference(seed: int, step: int, stream: int) -> float:
            key = mix((seed + (stream + 1) * 0x9E3779B97F4A7C15) % 2 ** 64)
            return (mix((key + (step + 1) * 0x9E3779B97F4A7C15) % 2 ** 64) >> 11) / 2 ** 53

        seeds = [0, 1, 7, 2 ** 62 + 3, 2 ** 64 - 1, -5]
        steps = [0, 1, 1000, 5, 2 ** 40, 3]
        signed = torch.tensor([s - 2 ** 64 if s >= 2 ** 63 else s for s in seeds])
        for stream in (0, 0x5EC):
            got = _uniform(signed, torch.tensor(steps), stream).tolist()
            assert got == [reference(s % 2 ** 64, t, stream) for s, t in zip(seeds, steps)]


class TestFilteredDistribution:
    """Over many draws the frequencies are the filtered softmax's, by the filters'
    definitions written out here one token at a time."""

    ROW = torch.tensor([2.0, 1.6, 1.1, 0.7, 0.2, -0.4, -1.0, -2.0])

    @classmethod
    def expected(cls, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0) -> torch.Tensor:
        probs = torch.softmax(cls.ROW.double() / temperature, dim=-1)
        keep = torch.zeros_like(probs)
        before = 0.0
        for rank, token in enumerate(probs.argsort(descending=True).tolist()):
            p = float(probs[token])
            if ((top_k <= 0 or rank < top_k) and before < top_p
                    and p >= min_p * float(probs.max())):
                keep[token] = p
            before += p
        return keep / keep.sum()

    @pytest.mark.parametrize("kw", [dict(top_k=3), dict(top_p=0.75), dict(min_p=0.3),
                                    dict(top_k=5, top_p=0.9, min_p=0.1, temperature=0.7),
                                    dict(top_k=6, temperature=1.5)])
    def test_frequencies_match_the_filtered_softmax(self, kw):
        n = 8000
        tokens = Sampler()(self.ROW.repeat(n, 1), [params(seed=3, step=i, **kw)
                                                   for i in range(n)])
        freq = torch.bincount(tokens, minlength=8).double() / n
        want = self.expected(**kw)
        assert freq[want == 0].sum() == 0, (freq, want)
        assert torch.allclose(freq, want, atol=0.015), (freq, want)
