"""`--quantization`: the formats (`model/quant/`), the one Linear that holds them
(`model/linear.py`), a GGUF's own 4-bit blocks, and the Engine on the default model held to
the fp32 model of the same weights dequantized."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from radixserve.model.linear import Linear, ShardSpec
from radixserve.model.quant.gguf_q4 import block_groups, read_q4_tensors
from radixserve.model.quant.groups import Groups
from radixserve.model.quant.int4 import Int4Weight
from radixserve.model.quant.int8 import Int8Weight
from bench.quant import TEXT
from radixserve.config import DEFAULT_MODEL
from tests.conftest import ENGINE_TEST_DEFAULTS, checked_engine
from tests.test_engine_exact import QUESTIONS, SYSTEM, chat

TIE_GAP = 1e-3
"""The tie rule of a quantized path: where its greedy tokens first differ from the fp32
reference's, the reference's top-2 logit gap there must be below this. q4 holds the very
weights the reference runs (the GGUF's blocks, dequantized by the converter) and computes
in fp32, so only a near-tie may flip. int8 holds them in 8 bits with a scale and low per
the same 32 inputs: a group whose 4-bit codes span 0..15 as codes 17q (exact but for the
rounding of its scale), any other to within 1/510 of its range, which moves this model's
logprobs by under 2e-5 (measured on `bench/quant.py`'s text and the long-system prompt;
one scale per output channel moved them by up to ~0.5)."""
LOGPROB_TOL = 1e-3
"""Prompt logprobs within this of the fp32 reference, at every token."""


def _q4_blocks(kind: str, rows: int, blocks: int, seed: int = 0) -> np.ndarray:
    """Random raw blocks of `kind` with finite fp16 scales: `[rows, bytes per row]`."""
    rng = np.random.default_rng(seed)
    size = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}[kind]
    data = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    heads = 2 if kind == "Q4_0" else 4
    scales = (rng.standard_normal((rows, blocks, heads // 2)) * 0.01).astype(np.float16)
    data[..., :heads] = scales.view(np.uint8).reshape(rows, blocks, heads)
    return data.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_gguf_blocks_repack_to_the_files_values(kind: str) -> None:
    """Codes, scales and lows taken from the blocks are gguf's own dequantization, bit for
    bit, and so are the kernel's values, on its few-rows path and its dense one."""
    import gguf

    data = _q4_blocks(kind, rows=32, blocks=2)
    want = torch.from_numpy(gguf.dequantize(data, gguf.GGMLQuantizationType[kind]).copy())
    groups = block_groups(data, kind)
    assert torch.equal(groups.dequantize(), want)
    packed, eye = Int4Weight(groups), torch.eye(want.shape[1])
    # 128 rows: dequantize + sgemm (the kernel's DENSE_FROM is 80).
    assert torch.equal(packed.matmul(eye.repeat(2, 1), None)[:len(eye)].t(), want)
    assert torch.equal(torch.cat([packed.matmul(rows, None) for rows in eye.split(4)]).t(),
                       want)


def test_q8_0_runs_as_the_files_codes_exactly() -> None:
    import gguf

    from radixserve.model.quant.gguf_q8 import q8_0_weight

    w = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32)
    data = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    want = torch.from_numpy(gguf.dequantize(data, gguf.GGMLQuantizationType.Q8_0).copy())
    head = q8_0_weight(data)
    assert torch.equal(head.dequantize(), want)
    assert torch.equal(head.matmul(torch.eye(96), None).t(), want)
    assert torch.equal(head.matmul(torch.eye(96)[:5], None).t(), want[:, :5])


def test_default_gguf_q4_blocks_equal_the_converted_weights(model_dir) -> None:
    """Every projection of the default Q4_1 file, repacked with llama.cpp's q/k row order
    undone, equals the converter's fp32 weights element for element."""
    from safetensors import safe_open

    from radixserve.model.loader import default_gguf_path

    groups = read_q4_tensors(default_gguf_path(), heads=9, kv_heads=3)
    assert len(groups) == 30 * 7
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for name, g in groups.items():
            assert torch.equal(g.dequantize(), f.get_tensor(name)), name


def _assert_fp32_matmul(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                        bias: torch.Tensor | None) -> None:
    """`got` is x w^T + bias up to fp32 rounding: within a few ulps of the sum of the
    terms' magnitudes (the float64 product is the reference)."""
    want = x.double() @ w.double().t()
    size = x.double().abs() @ w.double().abs().t()
    if bias is not None:
        want, size = want + bias.double(), size + bias.double().abs()
    assert ((got.double() - want).abs() <= 4e-7 * size + 1e-30).all(), \
        ((got.double() - want).abs() / size).max()


@pytest.mark.parametrize("n,k", [(64, 96), (33, 64), (7, 320)])
@pytest.mark.parametrize("bits,packed", [(4, Int4Weight), (8, Int8Weight)])
def test_quantized_matmuls_equal_the_fp32_matmul_of_their_weights(n, k, bits, packed) -> None:
    """Both kernels, at decode's row counts (1 to 7: their vector path, up to 4 rows of x
    a pass) and prefill's (96, from the kernel's DENSE_FROM of 80: dequantize + sgemm),
    with and without a bias, odd output counts included; each weight within half a step
    of its float value."""
    torch.manual_seed(n + k)
    w = torch.randn(n, k) * 0.05
    groups = Groups.quantize(w, bits)
    step = groups.scale.repeat_interleave(32, 1)
    assert ((groups.dequantize() - w).abs() <= step / 2 * 1.01).all()
    weight = packed(groups)
    for m in (1, 2, 3, 4, 7, 96):
        x = torch.randn(m, k)
        for bias in (None, torch.randn(n)):
            _assert_fp32_matmul(weight.matmul(x, bias), x, groups.dequantize(), bias)
    x = torch.randn(2, 3, k)  # leading dimensions, as a module's input may have
    assert weight.matmul(x, None).shape == (2, 3, n)


@pytest.mark.parametrize("method", ["none", "int8", "q4"])
def test_shards_of_a_fused_linear_recombine(method: str) -> None:
    """Column shards (each fused part split alike) concatenate, and row shards (bias on
    rank 0 only) sum, to the unsharded layer: what tensor parallelism adds on top is the
    gather and the all-reduce."""
    torch.manual_seed(0)
    k, parts = 128, (64, 32, 32)
    weights = [torch.randn(p, k) * 0.05 for p in parts]
    biases = [torch.randn(p) for p in parts]

    def layer(shard: ShardSpec) -> Linear:
        lin = Linear(k, parts, bias=True, shard=shard)
        for i, (w, b) in enumerate(zip(weights, biases)):
            lin.load("weight", i, w)
            lin.load("bias", i, b)
        if method != "none":
            lin.quantize(method)
        return lin

    x = torch.randn(3, k)
    full = layer(ShardSpec())(x)
    cols = [layer(ShardSpec("column", r, 2))(x) for r in range(2)]
    # Rank r holds its half of each part: interleave the parts back.
    halves = [c.split([p // 2 for p in parts], dim=-1) for c in cols]
    gathered = torch.cat([torch.cat([h[i] for h in halves], -1) for i in range(3)], -1)
    # A row-parallel rank reads its slice of the inputs (the previous layer's column shard).
    rows = sum(layer(ShardSpec("row", r, 2))(x.chunk(2, -1)[r]) for r in range(2))
    torch.testing.assert_close(gathered, full, rtol=0, atol=1e-5)
    torch.testing.assert_close(rows, full, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="does not divide"):
        Linear(k, (65,), shard=ShardSpec("column", 0, 2))
    if method != "none":  # a row shard of 48 inputs is not whole groups of 32
        with pytest.raises(ValueError, match="divisible by 32"):
            Linear(96, (32,), shard=ShardSpec("row", 0, 2)).quantize(method)
        with pytest.raises(ValueError, match="whole groups of 32, not at 48:96"):
            Linear(96, (32,), shard=ShardSpec("row", 1, 2)).quantize(
                method, [Groups.quantize(torch.randn(32, 96), 4)])


def test_a_mixed_gguf_and_a_float_checkpoint(tmp_path) -> None:
    """q4 on a GGUF whose q/k/v are Q4_0 and Q4_1, whose other projections are float32
    or Q8_0, and whose tied embedding is Q8_0: the 4-bit parts are the file's blocks, the
    rest quantized at load, the head the file's Q8_0 in two halves; on a
    Hugging Face directory, every part is quantized at load. Either way the logits are
    those of the fp32 model holding the same values dequantized, up to fp32 rounding."""
    from radixserve.config import EngineConfig
    from radixserve.messages import SeqSampling
    from radixserve.worker.seq_rows import whole_tables_step
    from radixserve.model.llama import FUSED, DecoderModel
    from radixserve.model.loader import resolve_model
    from radixserve.worker.worker import Worker
    from tests.factories import tiny_model_dir
    from tests.gguf_files import write_gguf

    hf_dir = tiny_model_dir(tmp_path, hidden_size=64, intermediate_size=128)
    path = write_gguf(hf_dir, tmp_path / "mixed.gguf", quantized={
        "attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q4_1", "ffn_down": "Q8_0",
        "token_embd": "Q8_0"})
    greedy = SeqSampling(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, seed=0, step=0)
    prefill = whole_tables_step([[0]], input_ids=list(range(1, 9)), q_lens=[8], kv_lens=[8],
                                sample=[greedy], logprobs=[None])

    def run(model: str, directory, file_parts: set[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """q4's logits, and the fp32 logits of the weights q4 holds, dequantized."""
        worker = Worker(EngineConfig(model=model, quantization="q4", max_total_tokens=64),
                        directory)
        reference = DecoderModel(worker.model_config, 64)
        reference.load_weights(directory)
        for name, linear in reference.linears().items():
            owner, _, fused = name.rpartition(".")
            for i, proj in enumerate(FUSED.get(fused, (fused,))):
                if f"model.{owner}.{proj}.weight" not in file_parts:  # the file's: as loaded
                    w = linear.weight.data[linear.part_rows(i)]
                    w.copy_(Groups.quantize(w, 4).dequantize())
        out = []
        sample = worker.rows.apply(prefill)
        for model_ in (worker.model, reference):
            meta = worker._metadata(worker.rows.step(prefill, sample, worker.page_size), None)
            worker.backend.begin_forward(meta)
            out.append(model_(torch.tensor(prefill.input_ids), torch.arange(8), torch.arange(8),
                              worker.backend, worker.pool.layers))
        report = worker.quantization
        assert report.file_parts == len(file_parts) and \
            report.file_parts + report.float_parts == 2 * 7
        assert report.head_format == ("Q8_0" if file_parts else "dense")
        return out[0], out[1]

    with torch.inference_mode():
        file_parts = set(read_q4_tensors(path, heads=4, kv_heads=2))
        assert len(file_parts) == 2 * 3
        for got, want in (run(str(path), resolve_model(str(path)), file_parts),
                          run(str(hf_dir), hf_dir, set())):
            # The float parts left unquantized would move these logits by ~4.
            assert (got.log_softmax(-1) - want.log_softmax(-1)).abs().max() < 1e-4


def test_refusals(tmp_path) -> None:
    from radixserve import Engine
    from radixserve.model.config import ModelConfig
    from radixserve.model.quantize import check_quantization
    from tests.factories import tiny_model_dir

    with pytest.raises(ValueError, match="quantization must be none, int8 or q4"):
        Engine("smollm2-135m", quantization="q8")
    mc = ModelConfig.from_dir(tiny_model_dir(tmp_path, hidden_size=48, num_heads=4,
                                             num_kv_heads=2, intermediate_size=96))
    with pytest.raises(ValueError, match="runs weight-only CPU kernels"):
        check_quantization("int8", torch.device("cuda"), mc)
    for method in ("q4", "int8"):
        with pytest.raises(ValueError, match="input size divisible by 32: this projection is"):
            check_quantization(method, torch.device("cpu"), mc)
    check_quantization("none", torch.device("cuda"), mc)


def test_a_machine_without_a_compiler_is_told_which_is_missing(monkeypatch) -> None:
    import radixserve.native as native

    monkeypatch.setenv("CXX", "no-such-c++")
    with pytest.raises(native.BuildError, match="need no-such-c\\+\\+ on PATH"):
        native.load.__wrapped__()


def test_cli_refuses_an_unknown_quantization_before_starting() -> None:
    from radixserve.cli import main

    with pytest.raises(ValueError, match="quantization must be none, int8 or q4, got 'q8'"):
        main(["serve", "--quantization", "q8"])


FEW_SHOT = ("Q: What is the plural of mouse?\nA: mice\nQ: What is the plural of child?\n"
            "A: children\nQ: What is the plural of goose?\nA:")
AGENT = ("You are an agent with tools. To call one, answer with one line of JSON: "
         '{"tool": NAME, "args": {...}}. Tools: search(query), calculator(expression), '
         "weather(city). Answer only with the call.")


def _prompts(tokenizer) -> list[list[int]]:
    """A question, a long system prompt, few-shot, multi-turn, and an agent's tool call."""
    def messages(*turns: tuple[str, str]) -> list[int]:
        return tokenizer.encode(tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in turns], tokenize=False,
            add_generation_prompt=True))

    return [chat(tokenizer, QUESTIONS[0]), chat(tokenizer, QUESTIONS[3], SYSTEM),
            messages(("user", FEW_SHOT)),
            messages(("user", "Hi! I am planning a trip to Rome."),
                     ("assistant", "Great choice! How can I help?"),
                     ("user", "What should I see on the first day?")),
            messages(("system", AGENT), ("user", "What is 17 times 23?"))]


def _assert_near_reference(got: list[int], ref, what: str) -> None:
    for i, (a, b) in enumerate(zip(got, ref.tokens)):
        if a != b:
            assert ref.gaps[i] < TIE_GAP, (
                f"{what}: token {i} is {a}, reference {b} (top-2 gap {ref.gaps[i]:.3f})")
            return


@pytest.mark.parametrize("method,backend,layout", [
    ("q4", "torch", "paged"), ("q4", "torch", "virtual"), ("q4", "triton", "paged"),
    ("int8", "torch", "paged"), ("int8", "torch", "virtual"), ("int8", "triton", "paged")])
def test_engine_greedy_and_logprobs_near_the_dequantized_fp32_model(
        hf, tokenizer, method, backend, layout) -> None:
    """The fp32 reference is transformers on the converted model: the GGUF's Q4_1 blocks
    dequantized, which `q4` holds as they are and `int8` to within its 8-bit step (see
    TIE_GAP). Prefill (in chunks; the second round from the cache) and decode both run the
    quantized projections. Teacher-forced on the long-system prompt and on plain prose,
    the top-1 token agrees with fp32's at >= 97% of positions and the perplexity is within
    1% (the issue's bar for `int8`)."""
    # The interpreted Triton kernels are slow on the CPU: one short prompt, one round there
    # (the layouts and backends only move KV; the projections are the same everywhere).
    triton = backend == "triton" or layout == "virtual"
    with checked_engine(DEFAULT_MODEL, **ENGINE_TEST_DEFAULTS, quantization=method,
                        attention_backend=backend, kv_layout=layout, page_size=16,
                        chunked_prefill_size=64, max_running_requests=32) as engine:
        _check_near_reference(engine, hf, tokenizer, method, triton)


def _check_near_reference(engine, hf, tokenizer, method: str, triton: bool) -> None:
    """`triton`: the short form (one short prompt, one round, no teacher forcing)."""
    report = engine.worker.quantization  # the model by name: the GGUF's blocks, not floats
    assert report.file_parts == (210 if method == "q4" else 0)
    assert report.head_format == ("Q8_0" if method == "q4" else "dense")
    new = 3 if triton else 12
    prompts = _prompts(tokenizer)[:1 if triton else None]
    for _ in range(1 if triton else 2):
        results = engine.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": new, "temperature": 0, "ignore_eos": True},
            return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
        for i, (ids, res) in enumerate(zip(prompts, results)):
            _assert_near_reference(res["output_ids"], hf.greedy(ids, new), f"#{i}")
    ids, res = (prompts[0], results[0]) if triton else (prompts[1], results[1])
    ref = hf.logprobs(ids + res["output_ids"])
    meta = res["meta_info"]
    errors = [abs(lp - float(ref[k - 1, t])) for k, (lp, t, _) in
              enumerate(meta["input_token_logprobs"]) if k > 0]
    assert max(errors) < LOGPROB_TOL, max(errors)
    if not triton:
        _assert_teacher_forced(meta, ref, ids)
        text = tokenizer.encode(TEXT)  # plain prose: per-channel int8 scored 94.8% here
        meta = engine.generate(input_ids=text, sampling_params={"max_new_tokens": 1},
                               return_logprob=True, logprob_start_len=0,
                               top_logprobs_num=1)["meta_info"]
        _assert_teacher_forced(meta, hf.logprobs(text), text)


def _assert_teacher_forced(meta, ref: torch.Tensor, ids: list[int]) -> None:
    """The issue's bar for `int8`: with the prompt `ids` fed, the top-1 token agrees with
    the fp32 reference's (`ref`, its log-softmax) at >= 97% of positions, and the
    perplexity is within 1%."""
    top1 = [top[0][1] for top in meta["input_top_logprobs"][1:len(ids)]]
    want = ref[:len(ids) - 1].argmax(-1).tolist()
    agree = sum(a == b for a, b in zip(top1, want)) / len(want)
    assert agree >= 0.97, agree
    got_nll = -sum(lp for lp, _, _ in meta["input_token_logprobs"][1:len(ids)]) / (len(ids) - 1)
    ref_nll = -sum(float(ref[k, t]) for k, t in enumerate(ids[1:])) / (len(ids) - 1)
    assert abs(math.exp(got_nll - ref_nll) - 1) < 0.01, math.exp(got_nll - ref_nll)
