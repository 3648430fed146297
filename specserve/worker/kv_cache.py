"""Size and allocate the paged KV cache for one model."""

from __future__ import annotations

import gc
import logging

import torch

from specserve.config import DEFAULT_CPU_KV_CACHE_BYTES, CacheConfig
from specserve.model.base import KVGeometry

logger = logging.getLogger(__name__)


def bytes_per_block(geom: KVGeometry, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * geom.num_layers * block_size * geom.num_kv_heads * geom.head_dim * elem


def num_blocks_for_budget(cache: CacheConfig, per_block: int, device: torch.device,
                          max_useful_blocks: int) -> int:
    """How many blocks the budget buys: an explicit override, a byte budget, or (CUDA) the
    free share of gpu_memory_utilization after the weights are loaded."""
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    if cache.kv_cache_memory_bytes is not None:
        budget = cache.kv_cache_memory_bytes
    elif device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()  # loading leaves cached blocks that are not really in use
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * cache.gpu_memory_utilization) - used
        logger.info("GPU memory: total %.2f GiB, in use %.2f GiB, KV budget %.2f GiB",
                    total / 2**30, used / 2**30, budget / 2**30)
    else:
        budget = DEFAULT_CPU_KV_CACHE_BYTES
    return max(0, min(budget // per_block, max_useful_blocks))


def allocate_kv_cache(geom: KVGeometry, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k, v) pair per layer, each [num_blocks, block_size, kv_heads, head_dim].

    Zero-filled: attention masks unused slots, but 0 * NaN garbage would still poison SDPA.
    """
    shape = (2, geom.num_layers, num_blocks, block_size, geom.num_kv_heads, geom.head_dim)
    cache = torch.zeros(shape, dtype=dtype, device=device)
    return [(cache[0, i], cache[1, i]) for i in range(geom.num_layers)]
