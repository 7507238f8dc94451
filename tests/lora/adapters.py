"""LoRA adapters made by PEFT itself for the tests, and transformers + PEFT's greedy output
under them (the reference an adapter is held to)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from tests.factories import build_once

ADAPTERS = {  # name: what `peft_adapter` makes it with
    "qv": dict(rank=8, alpha=16, targets=("q_proj", "v_proj")),
    "all": dict(rank=4, alpha=8, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                           "up_proj", "down_proj"), rslora=True),
    "mlp": dict(rank=16, alpha=4, targets=("gate_proj", "down_proj"), seed=2),
}


def peft_adapter(base: Path, root: Path, *, rank: int = 8, alpha: float = 16,
                 targets: tuple[str, ...] = ("q_proj", "v_proj"), seed: int = 0,
                 rslora: bool = False, scale: float = 1.0, **extra) -> Path:
    """A random LoRA adapter for the model at `base`, saved by PEFT (`save_pretrained`)
    under `root`: A and B both random (`init_lora_weights=False`), B times `scale`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    name = f"lora-{base.name}-r{rank}-a{alpha}-{'.'.join(targets)}-s{seed}-{rslora}-{scale}"
    name += "".join(f"-{k}{v}" for k, v in sorted(extra.items())).replace(" ", "")

    def write(out: Path) -> None:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32,
                                                     local_files_only=True)
        torch.manual_seed(seed)
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                            use_rslora=rslora, init_lora_weights=False, lora_dropout=0.0,
                            task_type="CAUSAL_LM", **extra)
        peft_model = get_peft_model(model, config)
        with torch.no_grad():
            for n, p in peft_model.named_parameters():
                if "lora_B" in n:
                    p.mul_(scale)
        peft_model.save_pretrained(out)

    return build_once(Path(root) / name, write)


@functools.cache
def _peft_model(base: Path, adapter: Path | None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32,
                                                 local_files_only=True)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


def peft_greedy(base: Path, adapter: Path | None, ids: list[int], max_new: int) -> list[int]:
    """transformers + PEFT's greedy continuation of `ids` under `adapter` (None: the base)."""
    model = _peft_model(base, adapter)
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(
            1, len(ids), dtype=torch.long), max_new_tokens=max_new, min_new_tokens=max_new,
            do_sample=False)
    return out[0, len(ids):].tolist()
