"""The sampler on synthetic logits: filters restrict the support, draws follow the
distribution, seeds reproduce, penalties follow their definitions."""

from __future__ import annotations

import torch

from radixserve.messages import LogitBias, SeqSampling
from radixserve.worker.sampler import Sampler, apply_penalties

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
        apply_penalties(logits, [p])
        want = torch.tensor([[2.0, 1.0 - 1.0 - 0.25, -1.0 - 0.5 - 0.25, 0.5]])
        assert torch.allclose(logits, want)
        logits = torch.tensor([[2.0, 1.0, -1.0, 0.5]])
        apply_penalties(logits, [params(repetition_penalty=2.0, prompt_ids=[0], output_ids=[2])])
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
