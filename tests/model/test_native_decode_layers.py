"""A step's layers in one native call (`model/native_layers.py`) against the module path on
random weights: the logits and every layer's stored K/V bit for bit, for fp32, q4 and int8
weights, decodes at batch 1, 4 and 6 (the GEMVs' passes of 4 and 8 rows) with contexts
ending on, before and after page boundaries and of several of attention's chunks (which a
team's threads share), extends (short, and past the GEMVs' row counts) alone and among
decodes, with and without a
tree-attention plan, and the caches' unused blocks poisoned with NaN (a read of them would
show). Greedy equality in an engine is `test_native_layers_keep_greedy_tokens`; the cases
that must fall back are checked by which path ran."""

from __future__ import annotations

import pytest
import torch

import radixserve.native as native
from radixserve.model.config import ModelConfig
from radixserve.model.llama import DecoderModel, silu_mul
from radixserve.model import native_layers
from radixserve.model.native_layers import NativeLayers
from radixserve.worker.attention.base import AttentionMetadata
from radixserve.worker.attention.torch_backend import TorchAttentionBackend
from radixserve.worker.cascade import CascadeOptions, plan_cascade
from tests.conftest import checked_engine
from tests.factories import tiny_model_dir
from tests.hf_reference import HFReference, assert_matches_reference

pytestmark = pytest.mark.skipif(not native.available(), reason="the CPU kernels do not build here")

PAGE = 8


def _model(quantization: str | None, seed: int, bias: bool = False) -> DecoderModel:
    config = ModelConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_layers=3,
                         num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5,
                         rope_theta=10000.0, max_position_embeddings=1024,
                         tie_word_embeddings=True, qkv_bias=bias, o_bias=bias, mlp_bias=bias)
    torch.manual_seed(seed)
    model = DecoderModel(config, 1024)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    if quantization is not None:
        model.quantize(quantization)
    model.pack()
    return model.eval()


def _step(model: DecoderModel, lens: list[int], seed: int, new: list[int] | None = None):
    """A step for sequences with `lens` cached tokens, the last `new` of each (default 1: a
    decode) the step's own: its metadata and caches with the past filled at random, every
    other block NaN."""
    gen = torch.Generator().manual_seed(seed)
    c = model.config
    new = new or [1] * len(lens)
    width = max(-(-n // PAGE) for n in lens) + 1
    blocks = torch.randperm(len(lens) * width + 3, generator=gen)
    tables = blocks[:len(lens) * width].view(len(lens), width).int()
    caches = []
    for _ in range(c.num_layers):
        k, v = (torch.full((len(blocks), PAGE, c.num_kv_heads, c.head_dim), float("nan"))
                for _ in range(2))
        for b, (n, q) in enumerate(zip(lens, new)):
            for t in range(n - q):  # the past; the new tokens' slots are the step's to write
                blk = int(tables[b, t // PAGE])
                k[blk, t % PAGE] = torch.randn(c.num_kv_heads, c.head_dim, generator=gen)
                v[blk, t % PAGE] = torch.randn(c.num_kv_heads, c.head_dim, generator=gen)
        caches.append((k, v))
    positions = torch.tensor([t for n, q in zip(lens, new) for t in range(n - q, n)])
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(new))
    slots = tables[seq, positions // PAGE].long() * PAGE + positions % PAGE
    q_lens = torch.tensor(new, dtype=torch.int32)
    q_start = torch.zeros(len(lens) + 1, dtype=torch.int32)
    q_start[1:] = q_lens.cumsum(0)
    meta = AttentionMetadata(q_start=q_start, q_lens=q_lens,
                             kv_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables,
                             slot_mapping=slots, max_q_len=max(new), max_kv_len=max(lens),
                             page_size=PAGE)
    ids = torch.randint(0, c.vocab_size, (len(positions),), generator=gen)
    return meta, caches, ids, positions


def _run(model: DecoderModel, native_on: bool, meta, caches, ids, positions,
         one_region: bool = True, logit_rows: torch.Tensor | None = None):
    model._native = NativeLayers.of(model, silu_mul, one_region) if native_on else None
    assert (model._native is not None) == native_on
    backend = TorchAttentionBackend()
    backend.begin_forward(meta)
    caches = [(k.clone(), v.clone()) for k, v in caches]
    assert backend.native_decode_args(caches[0][0]) is not None  # the step is native's case
    with torch.no_grad():
        logits = model(ids, positions, torch.arange(len(ids)) if logit_rows is None
                       else logit_rows, backend, caches)
    return logits, caches


@pytest.mark.parametrize("quantization", [None, "q4", "int8"])
@pytest.mark.parametrize("lens", [[1], [8], [9], [37], [16, 1, 9, 63],
                                  [3, 9, 17, 8, 1, 30],
                                  [600], [300, 5, 520, 1]])  # attention's chunks of 256 keys
@pytest.mark.parametrize("one_region", [True, False])
def test_native_layers_equal_the_module_path(quantization, lens, one_region) -> None:
    model = _model(quantization, seed=len(lens))
    _assert_native_equals_modules(model, _step(model, lens, seed=sum(lens)), one_region)


def _assert_native_equals_modules(model: DecoderModel, step, one_region: bool = True,
                                  logit_rows: torch.Tensor | None = None) -> None:
    """The step's logits and every layer's stored K/V, native and module path, bit for bit."""
    want, want_caches = _run(model, False, *step, logit_rows=logit_rows)
    got, got_caches = _run(model, True, *step, one_region=one_region, logit_rows=logit_rows)
    assert not want.isnan().any()
    assert torch.equal(got, want)
    for got_kv, want_kv in zip(got_caches, want_caches):
        for a, b in zip(got_kv, want_kv):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


@pytest.mark.parametrize("quantization", [None, "q4"])
@pytest.mark.parametrize("lens, shared, new", [([40, 33, 60], 4, None),
                                               ([40, 33, 60], 4, [1, 6, 3]),
                                               ([300, 290, 301, 280, 270], 32, None)])
def test_tree_attention_steps_equal_the_module_path(quantization, lens, shared, new) -> None:
    """Decodes (and short extends) whose first `shared` blocks are one prefix, with a
    tree-attention plan: the native step reads the same key sets (own parts and shared
    runs) as the module path."""
    model = _model(quantization, seed=len(lens))
    meta, caches, ids, positions = _step(model, lens, seed=sum(lens), new=new)
    meta.block_tables[1:, :shared] = meta.block_tables[0, :shared]
    meta.cascade = plan_cascade(meta.block_tables.tolist(), lens, new or [1] * len(lens), PAGE,
                                CascadeOptions(max_levels=2, min_shared_tokens=1,
                                               min_group_size=2))
    assert meta.cascade is not None
    want, _ = _run(model, False, meta, caches, ids, positions)
    got, _ = _run(model, True, meta, caches, ids, positions)
    assert not want.isnan().any()
    assert torch.equal(got, want)


@pytest.mark.parametrize("quantization", [None, "q4"])
@pytest.mark.parametrize("lens, new", [([7], [7]), ([40], [9]), ([17, 5, 300], [1, 5, 9]),
                                       ([9, 16], [2, 8]), ([60], [60]), ([17, 300], [1, 140])])
def test_extends_equal_the_module_path(quantization, lens, new) -> None:
    """Steps of extends (a prompt's uncached tail, a chunk of 60 or of 140 rows, past the
    fp32 GEMV's 128), alone and among decodes: read causally as the module path reads them;
    logits for every row, for each sequence's last (as a step samples), and for none."""
    model = _model(quantization, seed=len(lens))
    step = _step(model, lens, seed=sum(lens), new=new)
    last = torch.tensor(new).cumsum(0) - 1
    for logit_rows in (None, last, last[:0]):
        _assert_native_equals_modules(model, step, logit_rows=logit_rows)


def test_biases_are_carried() -> None:
    model = _model(None, seed=3, bias=True)
    step = _step(model, [5, 12], seed=4)
    assert torch.equal(_run(model, True, *step)[0], _run(model, False, *step)[0])


def test_other_steps_and_models_take_the_module_path() -> None:
    model = _model(None, seed=5)
    meta, caches, _, _ = _step(model, [6, 10], seed=6)
    backend = TorchAttentionBackend()
    backend.begin_forward(meta)
    assert backend.native_decode_args(caches[0][0]) is not None
    assert backend.native_decode_args(caches[0][0].double()) is None  # a cache it cannot read
    assert NativeLayers.of(DecoderModel(model.config, 512), silu_mul) is None  # not packed
    model.layers[1].mlp.down_proj.lora = object()  # type: ignore[assignment]
    assert NativeLayers.of(model, silu_mul) is None


@pytest.mark.parametrize("quantization", ["none", "q4"])
def test_native_layers_keep_greedy_tokens(tmp_path_factory, monkeypatch, quantization) -> None:
    """An engine's greedy tokens with the native layers, without them, and (fp32)
    transformers'; the native path ran its steps' decodes."""
    model_dir = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models", num_layers=2,
                               hidden_size=64)
    prompts = [[5, 17, 230, 99, 12, 7], [1] + list(range(100, 119)), [42]]
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    runs = []
    calls = []
    real_run = NativeLayers.run

    def counted(self, *args):
        out = real_run(self, *args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(NativeLayers, "run", counted)
    for enabled in (True, False):
        monkeypatch.setattr(native_layers, "ENABLED", enabled)
        with checked_engine(model_dir, max_total_tokens=512, page_size=4,
                            quantization=quantization) as engine:
            runs.append([r["output_ids"] for r in engine.generate(
                input_ids=prompts, sampling_params=params)])
        assert any(calls) == enabled
        calls.clear()
    assert runs[0] == runs[1]
    if quantization == "none":
        hf = HFReference(model_dir)
        for ids, out in zip(prompts, runs[0]):
            assert_matches_reference(out, hf.greedy(ids, 10), "native layers")
