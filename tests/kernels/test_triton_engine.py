"""The engine end to end with the Triton attention backend (interpreted on the CPU) gives
the same greedy tokens as with the torch backend, on a tiny random Llama, in the paged
layout and in the virtual one (the kernels over the slots' contiguous views)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from tests.conftest import checked_engine  # noqa: E402
from tests.factories import tiny_model_dir  # noqa: E402

PROMPTS = [[5, 17, 230, 4000, 99, 12, 7], [1] + list(range(100, 140)), [42]]
LAYOUTS = {"paged": {"page_size": 4},
           "virtual": {"kv_layout": "virtual", "page_size": 8, "max_running_requests": 8}}
"""Per layout, what its engines get: small pages, so that steps mix decodes with extends
over cached pages (a virtual block must be whole memory pages: 8 tokens of this model)."""


@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_backend_matches_torch_backend(tmp_path_factory, layout):
    model_dir = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")
    device = "cpu" if os.environ["TRITON_INTERPRET"] != "0" else "cuda"
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    outputs = {}
    for backend in ("torch", "triton"):
        with checked_engine(model_dir, attention_backend=backend, device=device, dtype="float32",
                            chunked_prefill_size=16, max_total_tokens=512, debug_invariants=True,
                            **LAYOUTS[layout]) as engine:
            # The kernels read the virtual layout's views as contiguous ranges.
            assert getattr(engine.worker.backend, "contiguous", False) == (
                backend == "triton" and layout == "virtual")
            first = engine.generate(input_ids=PROMPTS, sampling_params=params)
            again = engine.generate(input_ids=PROMPTS, sampling_params=params)  # cache hits
            assert again[1]["meta_info"]["cached_tokens"] > 0
            outputs[backend] = [r["output_ids"] for r in first + again]
    assert outputs["triton"] == outputs["torch"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_cascade_matches_torch_backend(tmp_path_factory, layout):
    """Requests over one cached prompt prefix take tree-attention steps (gates lowered to
    fit the tiny prompts): the Triton engine runs them and gives the torch engine's
    greedy tokens."""
    model_dir = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")
    device = "cpu" if os.environ["TRITON_INTERPRET"] != "0" else "cuda"
    params = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    prefix = list(range(200, 237))
    prompts = [prefix + [7 + i, 300 + 5 * i] for i in range(4)] + [[9, 8, 7]]
    outputs, cascade_steps = {}, {}
    for backend in ("torch", "triton"):
        with checked_engine(model_dir, attention_backend=backend, device=device, dtype="float32",
                            chunked_prefill_size=16, max_total_tokens=512,
                            cascade_min_shared_tokens=8, cascade_min_group_size=2,
                            cascade_cost_model=False,  # tiny prompts: the gates decide
                            debug_invariants=True, **LAYOUTS[layout]) as engine:
            engine.generate(input_ids=prompts[:1], sampling_params=params)  # cache the prefix
            worker_backend = engine.worker.backend
            begin, seen = worker_backend.begin_forward, []

            def spy(meta, begin=begin, seen=seen):
                seen.append(meta.cascade is not None)
                begin(meta)

            worker_backend.begin_forward = spy
            outputs[backend] = [r["output_ids"] for r in
                                engine.generate(input_ids=prompts, sampling_params=params)]
            cascade_steps[backend] = sum(seen)
    assert cascade_steps["triton"] >= params["max_new_tokens"] - 1, cascade_steps
    assert outputs["triton"] == outputs["torch"]
