"""Tree (cascade) attention: the planner's groups and gates, the torch backend with a
plan equal to the plain path (fp32, within 1e-5) on random prefix trees, and its shared
runs read by the native kernel equal to the torch path's reads of them."""

from __future__ import annotations

import random

import pytest
import torch

import radixserve.native as native
from radixserve.config import EngineConfig
from radixserve.worker.attention import torch_backend
from radixserve.worker.attention.torch_backend import TorchAttentionBackend
from radixserve.worker.cascade import CascadeOptions, may_share, plan_cascade
from tests.factories import TreeStep, random_tree_step
from tests.worker.host_syncs import HostSyncs

ALL = CascadeOptions(max_levels=3, min_shared_tokens=1, min_group_size=2)


def attend(step: TreeStep, plan, num_heads: int, seed: int = 1,
           poison: bool = False) -> torch.Tensor:
    """One layer's attention output for `step` under `plan` (None: the plain path); with
    `poison`, NaN in the caches wherever no sequence has a token (past each context's end
    in its last block, which is its own), so that a read of it shows."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache = step.caches(num_heads, seed)
    if poison:
        page = step.page_size
        for table, kv in zip(step.block_tables, step.kv_lens):
            for cache in (k_cache, v_cache):
                cache[table[(kv - 1) // page], (kv - 1) % page + 1:] = float("nan")
    n = len(step.slots)
    q, k, v = (torch.randn(n, heads, step.head_dim, generator=gen).to(step.dtype)
               for heads in (num_heads, step.num_kv_heads, step.num_kv_heads))
    backend = TorchAttentionBackend()
    backend.begin_forward(step.metadata(plan))
    return backend.forward(q, k, v, k_cache, v_cache, step.head_dim ** -0.5)


class TestPlanner:
    def test_one_system_prompt(self):
        # Four decodes over the same 3 blocks, then one private block each.
        tables = [[0, 1, 2, 10 + i] for i in range(4)]
        plan = plan_cascade(tables, [60] * 4, [1] * 4, 16, ALL)
        assert plan is not None and len(plan.levels) == 1
        (run,) = plan.levels[0]
        assert run.seqs == [0, 1, 2, 3] and run.block_start == 0 and run.blocks == [0, 1, 2]
        assert plan.own_start == [48] * 4

    def test_two_levels(self):
        # System prompt [0, 1]; two few-shot sets [2] and [3], then private blocks.
        tables = [[0, 1, 2, 10], [0, 1, 2, 11], [0, 1, 3, 12], [0, 1, 3, 13], [0, 1, 14]]
        plan = plan_cascade(tables, [50, 50, 50, 50, 40], [1] * 5, 16, ALL)
        assert [len(level) for level in plan.levels] == [1, 2]
        assert plan.levels[0][0].seqs == [0, 1, 2, 3, 4]
        assert sorted((r.seqs, r.blocks) for r in plan.levels[1]) == [([0, 1], [2]), ([2, 3], [3])]
        assert plan.own_start == [48, 48, 48, 48, 32]

    def test_the_block_being_written_is_never_shared(self):
        # Both tables list block 2, but it holds the token this step writes: private.
        tables = [[0, 1, 2], [0, 1, 2]]
        plan = plan_cascade(tables, [40, 40], [1, 1], 16, ALL)
        assert plan.levels[0][0].blocks == [0, 1]
        # An extend chunk shares only the blocks wholly before its first new token.
        plan = plan_cascade([[0, 1, 2, 3], [0, 1, 2, 4]], [60, 60], [30, 1], 16, ALL)
        assert plan.levels[0][0].blocks == [0]

    def test_gates(self):
        tables = [[0, 1, 2, 10 + i] for i in range(4)]
        lens, q = [60] * 4, [1] * 4
        assert plan_cascade(tables, lens, q, 16, CascadeOptions(3, 49, 2)) is None
        assert plan_cascade(tables, lens, q, 16, CascadeOptions(3, 48, 2)) is not None
        assert plan_cascade(tables, lens, q, 16, CascadeOptions(3, 1, 5)) is None
        assert plan_cascade(tables[:1], lens[:1], q[:1], 16, ALL) is None
        deep = [[0, 1, 2, 10], [0, 1, 2, 11], [0, 1, 3, 12]]
        assert len(plan_cascade(deep, [60] * 3, [1] * 3, 16, CascadeOptions(1, 1, 2)).levels) == 1
        assert len(plan_cascade(deep, [60] * 3, [1] * 3, 16, CascadeOptions(2, 1, 2)).levels) == 2

    def test_may_share_rules_out_only_steps_with_no_plan(self):
        # The worker plans only a step that may share: a False must mean no plan.
        rng = random.Random(5)
        ruled_out = planned = 0
        for _ in range(300):
            step = random_tree_step(rng, page_size=rng.choice([4, 16]), levels=3,
                                    num_seqs=rng.randint(1, 12), extend_share=0.3)
            options = CascadeOptions(3, rng.choice([1, 16, 40]), rng.randint(2, 5))
            args = (step.block_tables, step.kv_lens, step.q_lens, step.page_size, options)
            plan = plan_cascade(*args)
            if not may_share(*args):
                assert plan is None
                ruled_out += 1
            planned += plan is not None
        assert ruled_out > 30 and planned > 30  # both sides of the check were exercised
        fresh = [[i] for i in range(8)]  # a prefill of fresh prompts: nothing before it
        assert not may_share(fresh, [30] * 8, [30] * 8, 16, ALL)


class TestCascadeEqualsPlain:
    @pytest.mark.parametrize("page_size", [1, 16])
    @pytest.mark.parametrize("group", [1, 3, 8], ids=lambda g: f"gqa{g}")
    @pytest.mark.parametrize("levels", [1, 2, 3])
    def test_random_trees(self, page_size, group, levels):
        rng = random.Random(page_size * 100 + group * 10 + levels)
        for trial in range(4):
            # One root: every sequence shares at least its run. Else maybe nothing is shared.
            step = random_tree_step(rng, page_size=page_size, levels=levels,
                                    num_seqs=rng.randint(2, 24), roots=1 if trial < 2 else None,
                                    extend_share=0.3 * (trial % 2))
            plan = plan_cascade(step.block_tables, step.kv_lens, step.q_lens, page_size, ALL)
            assert plan is not None or trial >= 2
            assert plan is None or len(plan.levels) <= levels
            want = attend(step, None, group * step.num_kv_heads, seed=trial)
            got = attend(step, plan, group * step.num_kv_heads, seed=trial)
            scale = float(want.abs().max())
            error = float((got - want).abs().max())
            assert error <= 1e-5 * scale, (page_size, group, levels, trial)

    def test_groups_of_one_to_sixteen_beside_plain_sequences(self):
        rng = random.Random(7)
        for size in (1, 2, 5, 16):
            step = random_tree_step(rng, page_size=16, levels=2, num_seqs=size, roots=1)
            for _ in range(3):  # sequences that share nothing, on the plain path
                step = step.concat(random_tree_step(rng, page_size=16, levels=2, num_seqs=1))
            plan = plan_cascade(step.block_tables, step.kv_lens, step.q_lens, 16, ALL)
            assert (plan is None) == (size == 1)
            want, got = attend(step, None, 6), attend(step, plan, 6)
            assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())

    def test_bf16_cache_is_close(self):
        rng = random.Random(3)
        step = random_tree_step(rng, page_size=16, levels=2, num_seqs=8, dtype=torch.bfloat16)
        plan = plan_cascade(step.block_tables, step.kv_lens, step.q_lens, 16, ALL)
        want, got = attend(step, None, 6), attend(step, plan, 6)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


class TestStepsWithoutAPlan:
    """Tree attention costs a step without a plan nothing: no split of its sequences is
    built, and a step of decodes reads nothing back from the tensors it is given."""

    def test_build_no_split(self, monkeypatch):
        built = []
        real = torch_backend.CascadeSplit
        monkeypatch.setattr(torch_backend, "CascadeSplit",
                            lambda meta: built.append(meta) or real(meta))
        rng = random.Random(5)
        for extends in (0.0, 0.3, 1.0):
            step = random_tree_step(rng, page_size=16, levels=2, num_seqs=6, roots=1,
                                    extend_share=extends)
            attend(step, None, 4)
        assert not built
        plan = plan_cascade(step.block_tables, step.kv_lens, step.q_lens, 16, ALL)
        attend(step, plan, 4)
        assert len(built) == 1

    @pytest.mark.skipif(not native.available(), reason="the CPU kernels do not build here")
    def test_decodes_read_nothing_back(self):
        step = random_tree_step(random.Random(6), page_size=16, levels=2, num_seqs=6, roots=1)
        k_cache, v_cache = step.caches(4, seed=0)
        q = torch.randn(len(step.slots), 4, step.head_dim)
        kv = torch.randn(len(step.slots), step.num_kv_heads, step.head_dim)
        backend = TorchAttentionBackend()
        with HostSyncs() as syncs:
            backend.begin_forward(step.metadata())
            for window in (None, 20, None):  # layers, one with a sliding window
                backend.forward(q, kv, kv, k_cache, v_cache, 0.1, window=window)
        assert syncs.seen == []


@pytest.mark.skipif(not native.available(), reason="the CPU kernels do not build here")
class TestNativeSharedRuns:
    @pytest.mark.parametrize("group", [1, 3, 8], ids=lambda g: f"gqa{g}")
    @pytest.mark.parametrize("num_seqs", [2, 6, 17, 40])
    @pytest.mark.parametrize("extends", [0.0, 0.3], ids=["decodes", "extends"])
    def test_equal_the_torch_path(self, group, num_seqs, extends, monkeypatch):
        # Runs of 1-40 blocks (up to 3 of the kernel's chunks) read by 2-40 sequences, so
        # that a run's rows x group fill fewer than 8 lanes (the dot kernel), one or several
        # lane blocks. All decodes: one native call per layer (`TorchAttentionBackend._tree`); with
        # prefill chunks, mostly longer than it reads, a native call per level, merged.
        rng = random.Random(group * 100 + num_seqs)
        for trial in range(3):
            step = random_tree_step(rng, page_size=16, levels=2, num_seqs=num_seqs, roots=1,
                                    blocks_per_run=(1, 40), extend_share=extends,
                                    head_dim=64)
            plan = plan_cascade(step.block_tables, step.kv_lens, step.q_lens, 16, ALL)
            assert plan is not None
            heads = group * step.num_kv_heads
            got = attend(step, plan, heads, seed=trial, poison=True)
            with monkeypatch.context() as m:
                m.setattr(native, "decode_attention_fits", lambda cache: False)
                want = attend(step, plan, heads, seed=trial)
            error = float((got - want).abs().max())
            assert error <= 1e-5 * float(want.abs().max()), (group, num_seqs, trial)


class TestOptions:
    @pytest.mark.parametrize("option, value", [
        ("cascade_max_levels", 0), ("cascade_min_group_size", 0),
        ("cascade_min_shared_tokens", -1), ("cascade_max_levels", 1.5)])
    def test_bad_values_name_the_option(self, option, value):
        with pytest.raises(ValueError, match=option):
            EngineConfig.from_kwargs(**{option: value})

    def test_server_flags(self, capsys):
        from radixserve.cli import main

        with pytest.raises(SystemExit):
            main(["serve", "--help"])
        text = capsys.readouterr().out
        for flag in ("--enable-cascade-attention", "--no-enable-cascade-attention",
                     "--cascade-max-levels", "--cascade-min-shared-tokens",
                     "--cascade-min-group-size"):
            assert flag in text
