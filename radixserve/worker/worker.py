"""The worker: model weights, the KV pool, the attention backend and the sampler.

A step message names only what changed in the batch it keeps (`seq_rows.py`), from the
Engine in-process or a process wrapper's socket. A step runs in two halves, launch (up to
its sampled tokens, on the device) and collect (its answers read back): with overlap the
next is launched first. Under tensor parallelism it is one rank (`tensor_parallel.py`):
rank 0 shares each call with the others, which run theirs in `follow`.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, TypeVar

import msgspec
import torch

from radixserve.config import EngineConfig
from radixserve.disk_layout import entry_dirs
from radixserve.lora.slots import LoraSlots
from radixserve.messages import (DecodePath, ForwardBatch, ForwardResult, LoadLoraRequest,
                                 ProfileCall, ReleaseViewsRequest, SeqSampling, WorkerCall,
                                 WorkerInfo)
from radixserve.model.config import ModelConfig
from radixserve.model.linear import can_pack
from radixserve.model.llama import DecoderModel
from radixserve.model.shards import ModelShards
from radixserve.model.quantize import check_quantization, quantize_model
from radixserve.worker.attention.base import AttentionBackend, AttentionMetadata, StepLengths
from radixserve.worker.attention.registry import create_backend
from radixserve.worker import cuda_graph
from radixserve.worker.cascade import CascadeOptions, CascadePlan, may_share, plan_cascade
from radixserve.worker.cascade_cost import CascadeCost
from radixserve.worker.cuda_graph import DecodeGraphs
from radixserve.worker.device import resolve_device, resolve_dtype
from radixserve.worker.kv_disk import DiskStore, measure_costs, model_fingerprint
from radixserve.worker.kv_pool import KVPool
from radixserve.worker.pool_maker import pool_maker
from radixserve.worker.logits import StepSamples, read_logits, sample_logits
from radixserve.worker.profiler import StepProfiler
from radixserve.worker.sampler import Sampler
from radixserve.worker.seq_rows import SeqRows, StepSeqs, whole_tables_step
from radixserve.worker.staging import to_device
from radixserve.worker.tensor_parallel import Placement, TPGroup
from radixserve.worker.virtual_kv import VirtualKVPool

Shared = TypeVar("Shared", ForwardBatch, WorkerCall)
Answer = TypeVar("Answer")
Collect = Callable[[], ForwardResult]  # a launched step's answers, read back to the host

logger = logging.getLogger(__name__)
class Worker:
    def __init__(self, config: EngineConfig, model_dir: Path,
                 placement: Placement = Placement(), init_method: str | None = None) -> None:
        """`placement` and `init_method`: this rank of a tensor-parallel group and where the
        group meets (`tensor_parallel.rendezvous`; one rank, the default: no group)."""
        if os.environ.get("OMP_WAIT_POLICY", "").upper() == "ACTIVE":
            logger.warning("OMP_WAIT_POLICY=ACTIVE: spinning threads take the cores; PASSIVE "
                           "served 1.2-2x the throughput (bench/omp_policy.py)")
        self.device = resolve_device(config.device, placement)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self._threads = torch.get_num_threads()
        """This process's torch threads before it became a rank (an Engine's caller's)."""
        if self.device.type == "cpu" and placement.local_world > 1:
            # The host's ranks share its cores: two teams of all of them would contend.
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // placement.local_world))
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # where kernels launch and NCCL binds
        self.model_dir = model_dir
        mc = ModelConfig.from_dir(model_dir)  # refuses what it cannot run, before weights
        self.context_length = min(config.context_length or mc.max_position_embeddings,
                                  mc.max_position_embeddings)
        # A window no shorter than the context never binds: such a model runs as one with
        # full attention, on every path.
        self.model_config = mc = mc.for_context(self.context_length)
        self.page_size = config.page_size
        check_quantization(config.quantization, self.device, mc, placement.world)
        self.shards = ModelShards.of(mc, placement.rank, placement.world)  # refuses first
        self.tp = TPGroup(placement, init_method, self.device, config.tp_shared_memory)
        make_pool = pool_maker(config, mc, self.shards, self.context_length, self.dtype,
                               self.device, self.tp)
        with torch.device(self.device):
            self.model = DecoderModel(mc, self.context_length, self.tp)
        self.model.load_weights(model_dir)
        self.model.to(self.dtype).eval()
        self.model.rotary.float()  # cos/sin tables stay fp32, cast per use
        self.quantization = quantize_model(self.model, config.quantization, config.model)
        if can_pack(self.device, self.dtype):
            self.model.pack()
        self.loras = LoraSlots.create(config, self.model, mc, self.device)
        self.pool: KVPool = make_pool()
        self.views = self.pool if isinstance(self.pool, VirtualKVPool) else None
        """The pool where its layout maps views of the blocks for each step (the virtual
        ones): the step's tables are in them. None: the paged layout, whose block ids the
        attention reads in place."""
        self.rows = SeqRows(self.device, width=-(-self.context_length // self.page_size))
        self.backend: AttentionBackend = create_backend(config.attention_backend, self.device,
                                                        self.pool)
        self.cascade = CascadeOptions.from_config(config)
        self.fallbacks: list[str] = []
        """What this model could not have of the configured paths, and what it runs instead."""
        windows = [w for w in mc.layer_windows if w is not None]
        self.cascade_window = min(windows) if windows else None
        """Tree attention has no window: a step is planned only within the narrowest one."""
        if windows:
            if not self.backend.supports_window:
                self.backend = create_backend("torch", self.device, self.pool)
                self.fallbacks.append(f"sliding window {mc.sliding_window}: the torch "
                                      f"attention backend instead of {config.attention_backend}")
            if self.cascade is not None:
                self.fallbacks.append(f"sliding window {self.cascade_window}: tree attention "
                                      "only in steps whose contexts all fit the window")
            for line in self.fallbacks:
                logger.warning("%s: %s", model_dir, line)
        if self.backend.fuses_rope and not can_pack(self.device, self.dtype):
            self.model.fuse()  # fp32 on a CPU keeps the native kernels `pack` chose
        self.sampler = Sampler()
        self.graphs: DecodeGraphs | None = None
        if cuda_graph.wanted(config, self.device, self.tp.world, self.backend):
            self.graphs = self._decode_graphs(config, eager=self.device.type != "cuda")
        self._launched: deque[Collect] = deque()
        """The steps launched and not collected, oldest first."""
        self.profiler = StepProfiler(self.device)
        self.steps = 0
        """Steps collected so far (a profile's count of the steps it holds)."""
        self.disk = DiskStore(entry_dirs(Path(config.kv_disk_dir), self.tp.world)[self.tp.rank]
                              ) if config.kv_disk_dir else None
        self.fingerprint = (model_fingerprint(model_dir, self.dtype, self.page_size)
                            + ("" if config.quantization == "none" else f"-{config.quantization}")
                            + ("" if self.tp.world == 1 else f"-tp{self.tp.world}")
                            if self.disk is not None else "")
        self.disk_load_seconds_per_token = self.prefill_seconds_per_token = 0.0
        if self.disk is not None:
            self.prefill_seconds_per_token, self.disk_load_seconds_per_token = measure_costs(
                self.disk, self.pool, lambda n: self._launch(self._prefill(n))())
        if self.graphs is not None:
            self.graphs.capture()
        self.cascade_cost = None if self.cascade is None or not self.cascade.measured else (
            CascadeCost.measure(self.backend, self.shards.num_heads, self.pool.layers[0][0],
                                len(self.pool.layers), graph_step=0.0 if self.graphs is None
                                else self.graphs.replay_saving())
            if self.backend.timed_natively else CascadeCost.default(len(self.pool.layers)))
        """What tree attention costs here (`cascade_cost.py`), measured once now, on this
        device and backend, never in a request (the defaults for a backend whose timings
        mean nothing here); None: the gates alone decide."""

    def _decode_graphs(self, config: EngineConfig, eager: bool) -> DecodeGraphs:
        """Decode through graphs (`cuda_graph.py`), the pool's last block reserved for
        their padding rows: the scheduler is told of one block fewer (`info`)."""
        return DecodeGraphs(
            lambda ids, positions, rows, backend: self.model(
                ids, positions, rows, backend, self.pool.layers),
            self.backend, max_bs=config.cuda_graph_max_bs, context_length=self.context_length,
            page_size=self.page_size, reserved_block=self.pool.num_blocks - 1,
            device=self.device, eager=eager)

    def info(self) -> WorkerInfo:
        return WorkerInfo(
            model_path=str(self.model_dir),
            num_blocks=self.pool.num_blocks - (self.graphs is not None),
            page_size=self.page_size, context_length=self.context_length,
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=list(self.model_config.eos_token_ids), device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."), kv_pool_bytes=self.pool.nbytes,
            architecture=self.model_config.architecture,
            sliding_window=self.model_config.sliding_window, fallbacks=list(self.fallbacks),
            kv_fingerprint=self.fingerprint,
            disk_load_seconds_per_token=self.disk_load_seconds_per_token,
            prefill_seconds_per_token=self.prefill_seconds_per_token,
            kv_mapping_budget=self.pool.mappings()[1], tp_size=self.tp.world,
            loras=None if self.loras is None else self.loras.infos())

    def warmup(self) -> None:
        """One small step through every layer and the sampler, so the first real request
        does not pay for lazy initialisation (on every rank: shared as a step is). Writes
        only the first block, which holds nothing yet."""
        self.forward(self._prefill(min(8, self.page_size * self.pool.num_blocks)))

    def _prefill(self, n: int) -> ForwardBatch:
        """A prefill of `n` tokens into the first blocks, for start-up measurements (the
        scheduler's first step resets the rows: `WorkerRows.unknown`)."""
        pages = -(-n // self.page_size)
        return whole_tables_step(
            [list(range(pages))], input_ids=[0] * n, q_lens=[n], kv_lens=[n],
            sample=[SeqSampling(temperature=1.0, top_p=0.9, top_k=-1, min_p=0.0, seed=0, step=0)],
            logprobs=[None])

    def forward(self, batch: ForwardBatch) -> ForwardResult:
        """Run one step (rank 0 of a group: on every rank)."""
        self.launch(batch)
        return self.collect()

    def launch(self, batch: ForwardBatch) -> None:
        """Start a step: everything up to its sampled tokens, which stay on the device (rank
        0 of a group: on every rank). Its answers come from `collect`, in launch order."""
        self._launched.append(self._launch(batch) if self.tp.world == 1
                              else self._on_every_rank(batch, self._launch))

    def collect(self) -> ForwardResult:
        """The answers of the oldest step launched and not collected."""
        return self._launched.popleft()()

    def _on_every_rank(self, msg: Shared, run: Callable[[Shared], Answer]) -> Answer:
        """Rank 0 of a group: share `msg` with the other ranks and `run` it here too. Only
        in a group: one rank runs `run(msg)` alone (off is free)."""
        self.tp.share(msg)
        with self.tp.failing():
            return run(msg)

    def follow(self) -> None:
        """A rank but the first: run what rank 0 shares until it says stop."""
        while (msg := self.tp.receive()) is not None:
            if isinstance(msg, ForwardBatch):
                self._launch(msg)()  # launched and collected at once
            else:
                self._control(msg)

    def close(self) -> None:
        """Rank 0: let the other ranks go; every rank: leave the group. The captured
        graphs go (they hold this worker through their forward), so that the pool and the
        model are freed with the last reference, not at the next garbage collection."""
        self.graphs = None
        if self.tp.leader:
            try:
                self.tp.stop_followers()
            except RuntimeError:  # a rank died: the group is broken, the others exit anyway
                logger.warning("tensor-parallel ranks already gone at shutdown")
        self.tp.close()
        torch.set_num_threads(self._threads)

    @torch.inference_mode()
    def _launch(self, batch: ForwardBatch) -> Collect:
        """The step up to its sampled tokens, kept where the batch asks for the next step's
        placeholders; returns its second half, which reads its answers back."""
        start = time.perf_counter()
        sample = self.rows.apply(batch)
        failed = self._disk_transfers(batch) if self.disk is not None else []
        if not batch.q_lens:  # the disk tier's work alone
            result = ForwardResult(outputs=[], forward_seconds=time.perf_counter() - start,
                                   kv_failed=failed, kv_mappings=self.pool.mappings()[0])
            return lambda: result
        if batch.block_copies:
            self.pool.copy_blocks(batch.block_copies)
        step = self.rows.step(batch, sample, self.page_size)
        plan = self._plan(step)
        adapted = (self.loras is not None
                   and self.loras.begin(batch, step.q_lens_t, step.num_tokens, to_device))
        logits = None
        if self.graphs is not None and plan is None and not adapted:
            logits = self.graphs.run(step)
        graph: DecodePath = ("off" if self.graphs is None
                             else "replayed" if logits is not None else "eager")
        if logits is None:
            self.backend.begin_forward(self._metadata(step, plan))
            logits = self.model(step.input_ids, step.positions, step.logit_rows, self.backend,
                                self.pool.layers)
        samples = None if logits is None else sample_logits(step, logits.float(),
                                                            self.sampler)
        if batch.keep_tokens:
            self._keep_tokens(step, samples)
        mappings = 0
        if self.views is not None:
            self.views.map_ahead(step)  # while the queued kernels run
            mappings = self.views.mappings()[0]
        launched = time.perf_counter() - start

        @torch.inference_mode()
        def collect() -> ForwardResult:
            begun = time.perf_counter()
            outputs = [] if samples is None else read_logits(batch, samples, self.sampler)
            self.steps += 1
            return ForwardResult(
                outputs=outputs, forward_seconds=launched + time.perf_counter() - begun,
                shared_runs=plan.num_runs if plan else 0, decode_graph=graph,
                kv_failed=failed, kv_mappings=mappings)
        return collect

    def _keep_tokens(self, step: StepSeqs, samples: StepSamples | None) -> None:
        """Keep the tokens sampled for `step.batch.keep_tokens` in their rows, for the next
        step's placeholders: in a group, rank 0's on every rank (the others, which have no
        logits, sample nothing), shared on the device."""
        keep = step.batch.keep_tokens
        tokens = (torch.zeros(len(keep), dtype=torch.long, device=self.device)
                  if samples is None else samples.own_tokens(keep))
        if self.tp.world > 1:
            tokens = self.tp.all_reduce(tokens, "MAX")  # token ids are >= 0
        step.keep_tokens(tokens)

    def _disk_transfers(self, batch: ForwardBatch) -> list[int]:
        """The disk tier's part of a step, before anything writes KV: save (blocks freed
        for this step may be about to be reused), load into fresh blocks, drop. Returns
        the entries that could not be loaded. Called only with a disk tier."""
        disk = self.disk
        assert disk is not None
        if not (batch.kv_store or batch.kv_load or batch.kv_drop or batch.kv_sync):
            return []
        for t in batch.kv_store:
            disk.save(t.entry, t.key, self.pool.read_blocks(t.blocks))
        unread = []
        for t in batch.kv_load:
            kv = disk.load(t.entry, t.key, len(t.blocks), self.pool.buffer)
            unread.append(kv is None)
            if kv is not None:
                self.pool.write_blocks(t.blocks, kv)
        # An entry one rank could not read holds nothing whole: it failed for all.
        failed = [t.entry for t, bad in zip(batch.kv_load, self.tp.any_of(unread)) if bad]
        for entry in batch.kv_drop:
            disk.drop(entry)
        if batch.kv_sync:
            disk.sync()
        return failed

    def control(self, call: WorkerCall) -> dict[str, Any]:
        """Run a control call. A profile traces rank 0's steps alone (their time includes
        waiting on the others); the others run on every rank of a group."""
        if isinstance(call, ProfileCall):
            return self._control(call)
        answer = (self._control(call) if self.tp.world == 1
                  else self._on_every_rank(call, self._control))
        if "refused" in answer:  # (a refusal on every rank, not a broken group)
            raise ValueError(answer["refused"])
        return answer

    def _control(self, call: WorkerCall) -> dict[str, Any]:
        """A control call, between steps (scheduler/worker_calls.py `WorkerCalls.run`): a profile
        (ValueError if refused), or, after a cache flush with nothing running, the release
        of every view the KV layout keeps (no mapping is worth keeping then; answered with
        the mappings left, `kv_mappings`)."""
        if isinstance(call, ReleaseViewsRequest):
            self.pool.release_all()
            return {"kv_mappings": self.pool.mappings()[0]}
        if isinstance(call, ProfileCall):
            return self.profile(call)
        if self.loras is None:
            raise ValueError("LoRA serving is off: start with --enable-lora or --lora-paths")
        if isinstance(call, LoadLoraRequest):
            try:  # every rank reads the same files, so every rank refuses alike
                return msgspec.structs.asdict(self.loras.load(call.name, call.path, call.drop))
            except ValueError as e:
                return {"refused": str(e)}
        self.loras.unload(call.name)
        return {}

    def profile(self, request: ProfileCall) -> dict[str, Any]:
        """Start or stop a trace of the steps (see profiler.py); ValueError if refused."""
        if request.action == "start":
            return self.profiler.start(request.output_dir, self.steps)
        if request.output_dir is not None:
            raise ValueError("output_dir is chosen when the profile starts")
        return self.profiler.stop(self.steps)

    def _plan(self, step: StepSeqs) -> CascadePlan | None:
        """The step's tree attention where it may pay: on, within the narrowest window, a
        group that `may_share`, and a plan the cost model measured at start-up approves,
        against the graph's replay where the step would replay one. A step of fewer
        sequences than a group has (a lone request's) asks nothing more."""
        options = self.cascade
        if options is None or len(step.seqs) < options.min_group_size or (
                self.cascade_window is not None and max(step.kv_lens) > self.cascade_window):
            return None
        args = (step.host_tables(), step.kv_lens, step.q_lens, self.page_size, options)
        plan = plan_cascade(*args) if may_share(*args) else None
        if plan is None or self.cascade_cost is None:
            return plan
        graphed = self.graphs is not None and self.graphs.fits(step)
        return plan if self.cascade_cost.pays(plan, step.q_lens, self.page_size, graphed) else None

    def _metadata(self, step: StepSeqs, plan: CascadePlan | None) -> AttentionMetadata:
        """The step as the attention reads it: its tables and KV slots in the paged pool
        (the step's own block ids), or in the views a layout maps for it (`views`)."""
        if self.views is not None:
            tables = self.views.step_tables(step, plan)
            block_tables = to_device(tables.block_tables, self.device, torch.int32)
            slots, plan = tables.slot_mapping, tables.cascade
        else:
            block_tables, slots = step.block_tables(), step.slot_mapping()
        return AttentionMetadata(
            q_start=step.q_start, q_lens=step.q_lens_t, kv_lens=step.kv_lens_t,
            block_tables=block_tables, slot_mapping=slots, max_q_len=max(step.q_lens),
            max_kv_len=max(step.kv_lens), page_size=self.page_size, cascade=plan,
            kinds=step.kinds, lengths=StepLengths(step.q_lens, step.kv_lens))
