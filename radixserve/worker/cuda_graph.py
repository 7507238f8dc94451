"""CUDA-graph decode: a decode step's forward replayed as one graph, not ~30 launches a layer.

A graph replays fixed kernels on fixed addresses, so everything a decode forward reads lives
in buffers made once (`DecodeBuffers`): token ids, positions, KV lengths, block tables, KV
slots and the logits. A step copies its rows in and pads the batch to the next captured size
(1, 2, 4, 8, then every 8 up to `cuda_graph_max_bs`); a padding row has one token of context
in a block the scheduler never hands out (`reserved_block`), so it reads and writes nothing
of anyone's. What the kernels' launch depends on is fixed at capture: the batch size, and
the decode kernel's KV bound and split count, taken at the context length (a shorter
sequence's splits past its end exit at once).

A step runs eagerly, and `ForwardResult.decode_graph` says so, when it is not a plain decode
(a prefill chunk, a draft to verify, prompt logprobs), plans tree attention, or is wider
than the largest graph. A step that `fits` plans tree attention only where the cost model
says the plan beats the replay too (`cascade_cost.py`: what `replay_saving` measures at
start-up is counted against the plan). Off on the CPU, with an attention backend that cannot
be captured (`AttentionBackend.graph_capturable`: the torch one), with the virtual layout
(its views are remapped between steps), under tensor parallelism, and with
`disable_cuda_graph`. `eager=True` runs the same buffers and padding without capture: how
the CPU tests check this path.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from radixserve.config import EngineConfig
from radixserve.messages import ForwardBatch
from radixserve.worker.attention.base import AttentionBackend, AttentionMetadata
from radixserve.worker.seq_rows import StepSeqs

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionBackend], torch.Tensor]
"""The model's forward over (ids, positions, logit rows, backend), with the KV caches bound."""


def wanted(config: EngineConfig, device: torch.device, tp_world: int,
           backend: AttentionBackend) -> bool:
    """Whether this worker decodes through graphs (see the module's docstring)."""
    return (device.type == "cuda" and not config.disable_cuda_graph and backend.graph_capturable
            and config.kv_layout == "paged" and tp_world == 1)


def capture_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to `max_bs` (and `max_bs` itself)."""
    sizes = [s for s in (1, 2, 4) if s < max_bs] + list(range(8, max_bs, 8)) + [max_bs]
    return sorted(set(sizes))


def graphable(batch: ForwardBatch) -> bool:
    """A plain decode step: one new token and one sampled row per sequence (no draft, no
    prompt logprobs), so the logits' rows are the sequences in order."""
    return (all(q == 1 for q in batch.q_lens) and not batch.unsampled
            and not any(s.draft for s in batch.sample_steps)
            and all(lp is None or not lp.input_targets for lp in batch.logprobs))


class DecodeBuffers:
    """The graphs' inputs, `max_bs` rows each; a step fills the first rows and pads."""

    def __init__(self, max_bs: int, width: int, device: torch.device) -> None:
        def zeros(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.ids = zeros(max_bs, dtype=torch.long)
        self.positions = zeros(max_bs, dtype=torch.long)
        self.kv_lens = zeros(max_bs)
        self.block_tables = zeros(max_bs, width)
        self.slots = zeros(max_bs, dtype=torch.long)
        self.q_start = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.q_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.logit_rows = torch.arange(max_bs, dtype=torch.long, device=device)


class DecodeGraphs:
    """One graph per capture size over shared buffers and one memory pool."""

    def __init__(self, forward: Forward, backend: AttentionBackend, *, max_bs: int,
                 context_length: int, page_size: int, reserved_block: int,
                 device: torch.device, eager: bool = False) -> None:
        self.forward, self.backend, self.page_size = forward, backend, page_size
        self.context_length, self.reserved_block, self.eager = context_length, reserved_block, eager
        self.sizes = capture_sizes(max_bs)
        self.buffers = DecodeBuffers(max_bs, -(-context_length // page_size), device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (the smaller ones then fit in its memory pool).
        Each is run once eagerly before its capture: lazy initialisation (Triton's
        compilation, cuBLAS's workspace) must not happen inside one."""
        if self.eager:
            return
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):
            self._pad(0, bs)
            self._run(bs)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[bs] = self._run(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    @torch.inference_mode()
    def replay_saving(self, repeats: int = 5) -> float:
        """Seconds a replay of the smallest graph saves over the same step run eagerly (the
        median of `repeats` each); 0 where nothing is captured."""
        if self.eager or not self.graphs:
            return 0.0
        bs = self.sizes[0]
        self._pad(0, bs)

        def seconds(run: Callable[[], object]) -> float:
            torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            return time.perf_counter() - start
        eager = statistics.median(seconds(lambda: self._run(bs)) for _ in range(repeats))
        replay = statistics.median(seconds(self.graphs[bs].replay) for _ in range(repeats))
        return max(0.0, eager - replay)

    def fits(self, step: StepSeqs) -> bool:
        """Whether `step` can run in a graph: a plain decode no wider than the largest."""
        return len(step.q_lens) <= self.sizes[-1] and graphable(step.batch)

    def run(self, step: StepSeqs) -> torch.Tensor | None:
        """The step's logits `[B, vocab]` through the graph of the next size up; None when
        the step cannot run in one (it then runs eagerly)."""
        b = len(step.q_lens)
        if not self.fits(step):
            return None
        bs = next(s for s in self.sizes if s >= b)
        buf = self.buffers
        buf.ids[:b] = step.input_ids
        buf.positions[:b] = step.positions
        buf.kv_lens[:b] = step.kv_lens_t
        buf.block_tables[:b, :step.width] = step.block_tables()
        buf.slots[:b] = step.slot_mapping()
        self._pad(b, bs)
        if self.eager:
            return self._run(bs)[:b]
        self.graphs[bs].replay()
        return self.logits[bs][:b]

    def _pad(self, b: int, bs: int) -> None:
        """Rows `b:bs`: one token at position 0 in the reserved block."""
        buf = self.buffers
        buf.ids[b:bs] = 0
        buf.positions[b:bs] = 0
        buf.kv_lens[b:bs] = 1
        buf.block_tables[b:bs, 0] = self.reserved_block
        buf.slots[b:bs] = self.reserved_block * self.page_size

    def _run(self, bs: int) -> torch.Tensor:
        """The forward over the first `bs` rows of the buffers (captured, or eager)."""
        buf = self.buffers
        meta = AttentionMetadata(
            q_start=buf.q_start[:bs + 1], q_lens=buf.q_lens[:bs], kv_lens=buf.kv_lens[:bs],
            block_tables=buf.block_tables[:bs], slot_mapping=buf.slots[:bs], max_q_len=1,
            max_kv_len=self.context_length, page_size=self.page_size)
        self.backend.begin_forward(meta)
        return self.forward(buf.ids[:bs], buf.positions[:bs], buf.logit_rows[:bs], self.backend)
