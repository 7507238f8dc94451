"""Hugging Face transformers baselines: batched `generate`, and a hand-rolled prefix reuse.

Both run the same weights in float32 with greedy decoding and EOS ignored (no EOS id in the
generation config), so they produce the tokens radixserve produces and do the same work.
TTFT is when a batch's first token is chosen (a logits processor notes the time of its
first call); every token of a batch finishes when `generate` returns.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import torch

from bench.runners.base import Completion, Runner
from bench.workloads import Request, Workload


class _FirstToken:
    """A logits processor that only remembers when it was first called."""

    def __init__(self) -> None:
        self.at: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.at is None:
            self.at = time.perf_counter()
        return scores


class _HFRunner(Runner):
    def __init__(self, model_dir: Path, batch_size: int = 32) -> None:
        self.model_dir, self.batch_size = model_dir, batch_size
        self.model: Any = None

    def settings(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "dtype": "float32"}

    def open(self) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=torch.float32, local_files_only=True).eval()
        pad = self.model.generation_config.pad_token_id
        self.pad = pad if pad is not None else 0
        self.config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=self.pad)
        ids = torch.arange(100, 140)[None]
        self._generate(ids, torch.ones_like(ids), 4, None)  # warm-up

    def close(self) -> None:
        self.model = None

    @torch.inference_mode()
    def _generate(self, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int,
                  cache: Any) -> tuple[torch.Tensor, float]:
        """Greedy `generate` of exactly `new_tokens`; returns the new ids and the first
        token's time. With `cache`, only the positions past it are computed."""
        from transformers import LogitsProcessorList

        hook = _FirstToken()
        extra = {} if cache is None else {"cache": cache}
        config = copy.copy(self.config)
        config.max_new_tokens = new_tokens
        out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                  logits_processor=LogitsProcessorList([hook]), **extra)
        return out[:, ids.shape[1]:], hook.at or time.perf_counter()


class TransformersRunner(_HFRunner):
    """`model.generate` on left-padded batches of the wave, in arrival order."""

    name = "hf-generate"

    def generate(self, prompts: list[list[int]], requests: list[Request]) -> list[Completion]:
        submitted = time.perf_counter()
        out: list[Completion] = []
        for i in range(0, len(prompts), self.batch_size):
            batch = prompts[i:i + self.batch_size]
            width = max(map(len, batch))
            ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            n = max(r.output_tokens for r in requests[i:i + self.batch_size])
            new, first = self._generate(ids, mask, n, None)
            done = time.perf_counter()
            for row, req in zip(new.tolist(), requests[i:i + self.batch_size]):
                out.append(Completion(row[:req.output_tokens], 0, submitted, first, done))
        return out


class TransformersPrefixReuseRunner(_HFRunner):
    """Hand-rolled prefix reuse, the simplest honest version a transformers user would write.

    - A request that declares a shared prefix (`prefix_key`, `shared_len`) gets that
      prefix's KV from a forward pass computed once per key (the first time it is needed,
      inside the timed run), deep-copied and repeated over a batch of the requests of the
      same key and prompt length (equal lengths: no padding between prefix and suffix).
    - A conversation's next turn continues from its previous turn's cache (prompt +
      output), one conversation per batch: caches of different conversations are not
      stacked into one batch.
    - Anything else runs as plain batched `generate`.
    """

    name = "hf-prefix-reuse"

    def begin(self, workload: Workload) -> None:
        self._prefix: dict[str, Any] = {}
        self._turn_cache: dict[str, Any] = {}
        self._parents = {r.parent for r in workload.requests if r.parent is not None}

    def _prefix_cache(self, key: str, prefix: list[int]) -> tuple[Any, bool]:
        """The prefix's KV, and whether it was computed just now."""
        fresh = key not in self._prefix
        if fresh:
            with torch.inference_mode():
                self._prefix[key] = self.model(torch.tensor([prefix]), use_cache=True).cache
        return self._prefix[key], fresh

    def generate(self, prompts: list[list[int]], requests: list[Request]) -> list[Completion]:
        submitted = time.perf_counter()
        batches: dict[tuple, list[int]] = {}
        for i, (req, prompt) in enumerate(zip(requests, prompts)):
            if req.parent is not None and req.parent in self._turn_cache:
                key: tuple = ("turn", req.rid)
            elif req.prefix_key is not None:
                key = ("prefix", req.prefix_key, len(prompt))
            else:
                key = ("plain", len(prompt))
            batches.setdefault(key, []).append(i)
        done: dict[int, Completion] = {}
        for key, members in batches.items():
            for lo in range(0, len(members), self.batch_size):
                rows = members[lo:lo + self.batch_size]
                self._run_batch(key, rows, prompts, requests, submitted, done)
        return [done[i] for i in range(len(requests))]

    def _run_batch(self, key: tuple, rows: list[int], prompts: list[list[int]],
                   requests: list[Request], submitted: float, done: dict[int, Completion]) -> None:
        first_req = requests[rows[0]]
        fresh = False
        if key[0] == "turn":
            cache = self._turn_cache.pop(first_req.parent)  # its only child takes it
        elif key[0] == "prefix":
            prompt = prompts[rows[0]]
            cache, fresh = self._prefix_cache(key[1], prompt[:first_req.shared_len])
            cache = copy.deepcopy(cache)
            if len(rows) > 1:
                cache.batch_repeat_interleave(len(rows))
        else:
            cache = None
        reused = 0 if cache is None else cache.get_seq_length()
        ids = torch.tensor([prompts[i] for i in rows])
        n = max(requests[i].output_tokens for i in rows)
        new, first = self._generate(ids, torch.ones_like(ids), n, cache)
        finished = time.perf_counter()
        for j, (i, row) in enumerate(zip(rows, new.tolist())):
            req = requests[i]
            # As with a radix tree, the request that computes a prefix counts it as a miss.
            hit = 0 if fresh and j == 0 else reused
            done[i] = Completion(row[:req.output_tokens], hit, submitted, first, finished)
            if req.rid in self._parents and cache is not None:
                self._turn_cache[req.rid] = _row(cache, j)  # prompt + output but its last


def _row(cache: Any, j: int) -> Any:
    """Batch row `j` of a DynamicCache as a cache of its own (a copy)."""
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=[(layer.keys[j:j + 1].clone(), layer.values[j:j + 1].clone())
                                        for layer in cache.layers])
