"""`--quantization int8|q4` on CUDA: no CUDA kernels are wired for them, so the Engine
refuses at start-up, before the weights load (seconds, not a model load)."""

from __future__ import annotations

import pytest
import torch

import radixserve

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("method", ["int8", "q4"])
def test_quantization_on_cuda_is_refused_at_start_up(method: str) -> None:
    with pytest.raises(ValueError, match="weight-only CPU kernels"):
        radixserve.Engine(model="smollm2-135m", device="cuda", quantization=method).shutdown()
