"""One rank's model makes no collective call (issue 42: `TPGroup.all_reduce` ran 240 times
in a one-rank run): given a one-rank group, DecoderModel keeps none."""

from __future__ import annotations

import torch

from radixserve.model.config import ModelConfig
from radixserve.model.llama import DecoderModel
from radixserve.worker.tensor_parallel import TPGroup
from tests.factories import tiny_model_dir


class _Attention:
    """Stands in for an attention backend: the test counts collectives, not attention."""

    def forward(self, q, k, v, k_cache, v_cache, scale, window=None, rope=None):
        return q


def test_a_one_rank_forward_calls_no_collective(tmp_path, monkeypatch):
    calls: list[str] = []
    for name in ("all_reduce", "gather_columns"):
        real = getattr(TPGroup, name)
        monkeypatch.setattr(TPGroup, name,
                            lambda self, *a, _n=name, _r=real, **k:
                            calls.append(_n) or _r(self, *a, **k))
    config = ModelConfig.from_dir(tiny_model_dir(tmp_path))
    model = DecoderModel(config, 64, TPGroup())
    logits = model(torch.tensor([1, 2, 3]), torch.arange(3), torch.tensor([2]), _Attention(),
                   [(None, None)] * config.num_layers)
    assert logits.shape == (1, config.vocab_size)
    assert calls == []
