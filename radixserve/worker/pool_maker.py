"""The worker's KV pool, chosen and sized from the configuration: paged or virtual, on the
CPU or CUDA, from `max_total_tokens` or the memory the weights leave."""

from __future__ import annotations

from typing import Callable

import torch

from radixserve.config import EngineConfig
from radixserve.model.config import ModelConfig
from radixserve.model.shards import ModelShards
from radixserve.worker.kv_pool import KVPool
from radixserve.worker.tensor_parallel import TPGroup
from radixserve.worker.virtual_kv import VirtualKVPool

CPU_DEFAULT_POOL_TOKENS = 32768


def pool_maker(config: EngineConfig, mc: ModelConfig, shards: ModelShards, context_length: int,
               dtype: torch.dtype, device: torch.device, tp: TPGroup) -> Callable[[], KVPool]:
    """What makes the KV pool once the weights are in (on CUDA sized from what they
    leave), having checked what can refuse the configuration first (ValueError): the
    virtual layout's CPU pool is made now (its VMA budget), its CUDA page size checked."""
    page = config.page_size
    num_layers, heads, dim = mc.num_layers, shards.num_kv_heads, mc.head_dim

    def blocks(per_block: int | None = None) -> int:
        return num_blocks(config, per_block or KVPool.bytes_per_block(
            num_layers, page, heads, dim, dtype), device, tp)

    if config.kv_layout == "paged":
        return lambda: KVPool(num_layers, blocks(), page, heads, dim, dtype, device)
    slots = dict(num_slots=config.max_running_requests,
                 slot_blocks=-(-context_length // page))
    if device.type == "cpu":
        pool = VirtualKVPool(num_layers, blocks(), page, heads, dim, dtype, **slots,
                             map_limit=config.virtual_max_map_count)
        return lambda: pool
    from radixserve.worker import cuda_vmm, virtual_kv_cuda, virtual_pages

    if config.attention_backend == "torch":
        raise ValueError("kv_layout='virtual' on CUDA runs the Triton kernels only (SDPA "
                         "pads decodes into view positions nothing maps, which fault "
                         "there): use attention_backend='triton' or 'auto'")
    layout = virtual_pages.choose(config.virtual_page_layout, num_layers, page,
                                  heads * dim * dtype.itemsize, cuda_vmm.granularity(device))
    return lambda: virtual_kv_cuda.CudaVirtualKVPool(
        num_layers, blocks(layout.block_bytes), page, heads, dim, dtype, **slots,
        device=device, page_layout=layout.name)


def num_blocks(config: EngineConfig, per_block: int, device: torch.device, tp: TPGroup) -> int:
    """The pool's blocks: from max_total_tokens, or what fits in the memory left
    (`per_block` bytes each: a block's own, or its padded stride), on every rank."""
    if config.max_total_tokens is not None:
        return -(-config.max_total_tokens // config.page_size)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return tp.all_min(max(1, int(free * config.kv_memory_fraction) // per_block))
    return CPU_DEFAULT_POOL_TOKENS // config.page_size
