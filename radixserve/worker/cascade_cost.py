"""Whether a step's tree attention pays, from what the backend's attention measurably costs.

The gates (`CascadeOptions`) say which runs could be read once per group; whether that is
faster than each row reading them itself depends on the machine. On the CPU the shared pass
is bound by arithmetic (every row still scores every key of the run, only reading each key
once), while plain decode is bound partly by memory and partly by its own arithmetic, and
tree attention adds fixed work of its own (a pass per level, the merge of each grouped row's
parts, the split built once per step). So the costs are measured, once per worker at
start-up (`Worker.__init__`, never inside a request), on its device and through its backend:
the backend's own attention, timed on synthetic decode steps of the model's shapes (per-rank
heads, dtype, page size) over scratch caches, with and without a plan; on the CPU on one
thread and in its CPU time (on a busy machine a pool's threads wait for cores and wake late,
by more than a probe takes, while the work itself divides among threads alike on both
paths). Per layer:

    plain   = plain_key  * pairs                 pairs: sum over runs of rows x keys
    cascade = shared_key * pairs + sum over levels (per_level + per_row * rows)
              + (per_step + graph_step) / layers

(the rows' own parts are read the same either way and cancel). One rule on every device: a
plan runs when `cascade` is at most `1 - MARGIN` of `plain`, else the step takes the plain
path. `graph_step` counts only in a step that would otherwise replay a CUDA graph
(`cuda_graph.py`: a plain decode step, graphs captured): what the replay saves over the
same step run eagerly (`DecodeGraphs.replay_saving`, measured after capture; 0 on the CPU),
which a plan, run eagerly, gives up. Extend rows are costed as decode rows.

One measurement under load must not decide for the process's life: each coefficient is the
median of `ROUNDS` measurements (each the best of its repeats), and then held within
`BOUNDS`, a documented range around defaults, in units of `plain_key` (only ratios decide a
verdict): a probe the machine's other work slowed cannot veto tree attention (nor force
it) beyond what the range allows. The probes' scratch caches stay in cache while a step's
KV comes from memory, which costs plain decode more than the shared pass (it reads each
run once per row): the model then errs towards the plain path.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixserve.worker.attention.base import AttentionBackend, AttentionMetadata, StepLengths
from radixserve.worker.cascade import CascadePlan, SharedRun

MARGIN = 0.05
"""The share of the plain reads a plan must save: the model's error, not the plan,
should decide no step (a plan it wrongly takes then costs little)."""

SHORT, LONG = 128, 1024
"""Run lengths (tokens) of the probes: the slope between them is a key's cost, the rest
the fixed work."""
FEW, MANY = 8, 32
"""Rows of the probes' groups: the fixed work at both splits into per level and per row."""
LAYERS = 4
"""Forwards timed together, for a time well above the clock's grain."""
ROUNDS = 3
"""Measurements of every coefficient; the model takes each one's median."""

DEFAULT_PLAIN_KEY = 52e-9
"""A key's plain read where the probes measure none (the default model's shapes on a
2-core EPYC): the unit the bounds are in."""
BOUNDS = {"shared_key": (0.69, 0.5, 0.8), "per_level": (290.0, 100.0, 600.0),
          "per_row": (20.0, 5.0, 40.0), "per_step": (4800.0, 2400.0, 9600.0)}
"""Per coefficient, in units of `plain_key` (`shared_key` a ratio, the rest in keys' reads):
(default, lowest, highest). The defaults are what the default model's shapes measure on a
2-core EPYC (52, 36 ns a key; 15 us a level, 1 us a row, 250 us a step); the range, about
half to twice each, is what a measurement may move them to: a measurement past it is the
machine's load, not the kernel. At every corner of it a group of 64 sharing 1k tokens (the
bench's headline) pays, and 64 sharing a block or 4 sharing two do not
(`tests/worker/test_cascade_cost.py`).
`graph_step` is not bounded (it is 0 but on CUDA)."""


@dataclass(frozen=True)
class CascadeCost:
    """Seconds of one layer's attention, measured (`measure`)."""

    plain_key: float
    """A row reading one key of a run itself (all its heads)."""
    shared_key: float
    """A row's share of one key of a shared run read once for its group."""
    per_level: float
    per_row: float
    """A level's fixed work, and its work per grouped row (the merge of its parts)."""
    per_step: float
    """The plan's work once per step (the split into tensors, the kernel's key sets)."""
    num_layers: int
    graph_step: float = 0.0
    """What a step replaying a CUDA graph saves over running eagerly (0: no graphs)."""

    @classmethod
    def default(cls, num_layers: int) -> CascadeCost:
        """The documented defaults (`BOUNDS`, `DEFAULT_PLAIN_KEY`)."""
        key = DEFAULT_PLAIN_KEY
        return cls(plain_key=key, num_layers=num_layers,
                   **{name: key * default for name, (default, _, _) in BOUNDS.items()})

    def bounded(self) -> CascadeCost:
        """These costs held within `BOUNDS` (the defaults where `plain_key` is no time)."""
        key = self.plain_key
        if not key > 0:
            return dataclasses.replace(CascadeCost.default(self.num_layers),
                                       graph_step=max(0.0, self.graph_step))
        held = {name: key * min(high, max(low, getattr(self, name) / key))
                for name, (_, low, high) in BOUNDS.items()}
        return dataclasses.replace(self, graph_step=max(0.0, self.graph_step), **held)

    def pays(self, plan: CascadePlan, q_lens: list[int], page_size: int,
             graphed: bool = False) -> bool:
        """Whether `plan` makes the step's attention faster by at least `MARGIN`, and where
        the step would replay a graph (`graphed`), by what the replay saves too."""
        pairs = fixed = 0.0
        for level in plan.levels:
            rows = 0
            for run in level:
                run_rows = sum(q_lens[s] for s in run.seqs)
                pairs += run_rows * len(run.blocks) * page_size
                rows += run_rows
            fixed += self.per_level + self.per_row * rows
        per_step = self.per_step + (self.graph_step if graphed else 0.0)
        cascade = self.shared_key * pairs + fixed + per_step / self.num_layers
        return cascade <= (1 - MARGIN) * self.plain_key * pairs

    @classmethod
    def measure(cls, backend: AttentionBackend, num_heads: int, cache: torch.Tensor,
                num_layers: int, repeats: int = 3, graph_step: float = 0.0,
                rounds: int = ROUNDS) -> CascadeCost:
        """Time `backend` on probe steps (a group of `FEW` or `MANY` decodes sharing `SHORT`
        or `LONG` tokens, each with half a block of its own) with and without their plan,
        for `num_heads` query heads over caches shaped, typed and placed like one layer's
        K `cache` (not read: the probes have scratch caches of their own): each
        coefficient the median of `rounds`, then `bounded`."""
        page_size, num_kv_heads, head_dim = cache.shape[1:]
        probe = _Probe(backend, num_heads, num_kv_heads, head_dim, page_size, cache.dtype,
                       cache.device)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            found = [cls._once(probe, repeats, num_layers) for _ in range(max(1, rounds))]
        finally:
            torch.set_num_threads(threads)
        medians = {name: statistics.median(getattr(c, name) for c in found)
                   for name in ("plain_key", *BOUNDS)}
        return cls(num_layers=num_layers, graph_step=graph_step, **medians).bounded()

    @classmethod
    def _once(cls, probe: _Probe, repeats: int, num_layers: int) -> CascadeCost:
        """One measurement, unbounded."""
        few_short, few_long, many_short = (
            probe.time(rows, tokens, repeats)
            for rows, tokens in ((FEW, SHORT), (FEW, LONG), (MANY, SHORT)))
        span = FEW * (LONG - SHORT)
        plain_key = max(0.0, (few_long.plain - few_short.plain) / span)
        shared_key = max(0.0, (few_long.cascade - few_short.cascade) / span)

        def fixed(t: _Timing, rows: int) -> float:
            return t.cascade - t.plain - rows * SHORT * (shared_key - plain_key)

        per_row = max(0.0, (fixed(many_short, MANY) - fixed(few_short, FEW)) / (MANY - FEW))
        per_level = max(0.0, fixed(few_short, FEW) - FEW * per_row)
        return cls(plain_key, shared_key, per_level, per_row,
                   max(0.0, few_long.step_cascade - few_long.step_plain), num_layers)


@dataclass
class _Timing:
    """A probe's seconds, each path: a layer's attention, and the step's own work."""

    plain: float
    cascade: float
    step_plain: float
    step_cascade: float


class _Probe:
    """Synthetic decode steps over scratch caches, timed through the backend."""

    def __init__(self, backend: AttentionBackend, num_heads: int, num_kv_heads: int,
                 head_dim: int, page_size: int, dtype: torch.dtype, device: torch.device
                 ) -> None:
        self.backend, self.page_size, self.device = backend, page_size, device
        self.clock = _clock(device)
        self.heads, self.kv_heads, self.head_dim, self.dtype = (num_heads, num_kv_heads,
                                                                head_dim, dtype)
        blocks = LONG // page_size + MANY
        shape = (blocks, page_size, num_kv_heads, head_dim)
        self.caches = (torch.randn(shape, device=device).to(dtype),
                       torch.randn(shape, device=device).to(dtype))

    def step(self, rows: int, tokens: int, plan: bool) -> AttentionMetadata:
        """`rows` decodes sharing the first `tokens` (whole blocks), each with half a block
        of its own after them."""
        page, dev = self.page_size, self.device
        shared = tokens // page
        tables = torch.tensor([list(range(shared)) + [shared + i] for i in range(rows)],
                              dtype=torch.int32, device=dev)
        kv_len = shared * page + max(1, page // 2)
        kv_lens = torch.full((rows,), kv_len, dtype=torch.int32, device=dev)
        q_lens = torch.ones(rows, dtype=torch.int32, device=dev)
        run = SharedRun(list(range(rows)), 0, list(range(shared)))
        return AttentionMetadata(
            q_start=torch.arange(rows + 1, dtype=torch.int32, device=dev), q_lens=q_lens,
            kv_lens=kv_lens, block_tables=tables,
            slot_mapping=(tables[:, shared].long() * page + kv_len - 1 - shared * page),
            max_q_len=1, max_kv_len=kv_len, page_size=page,
            cascade=CascadePlan([[run]], [shared * page] * rows) if plan else None,
            lengths=StepLengths([1] * rows, [kv_len] * rows))

    def time(self, rows: int, tokens: int, repeats: int) -> _Timing:
        """The best of `repeats` (after one to warm up) of each path, interleaved: a layer is
        the mean of `LAYERS` forwards after the first, the step's own work `begin_forward`
        and what the first forward takes beyond a layer (what a backend makes once per
        step)."""
        q = torch.randn(rows, self.heads, self.head_dim, device=self.device).to(self.dtype)
        kv = torch.randn(rows, self.kv_heads, self.head_dim, device=self.device).to(self.dtype)
        metas = [self.step(rows, tokens, plan) for plan in (False, True)]
        layer, step = [float("inf")] * 2, [float("inf")] * 2
        for _ in range(repeats + 1):
            for i, meta in enumerate(metas):
                start = self.clock()
                self.backend.begin_forward(meta)
                self.backend.forward(q, kv, kv, *self.caches, self.head_dim ** -0.5)
                first = self.clock()
                for _ in range(LAYERS):
                    self.backend.forward(q, kv, kv, *self.caches, self.head_dim ** -0.5)
                one = (self.clock() - first) / LAYERS
                layer[i] = min(layer[i], one)
                step[i] = min(step[i], first - start - one)
        return _Timing(*layer, *step)


def _clock(device: torch.device) -> Callable[[], float]:
    """Seconds: the thread's CPU time on the CPU; elsewhere wall time once the device's
    queued work is done."""
    if device.type != "cuda":
        return time.thread_time

    def synced() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return synced
