"""Size and allocate the paged KV cache for one model."""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from specserve.config import DEFAULT_CPU_KV_CACHE_BYTES, CacheConfig
from specserve.model.base import KVGeometry, tensor_bytes

if TYPE_CHECKING:
    from specserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def bytes_per_block(geom: KVGeometry, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * geom.num_layers * block_size * geom.num_kv_heads * geom.head_dim * elem


@dataclass(frozen=True)
class GpuMemoryPlan:
    """Where the device's memory goes, measured once at start-up (bytes)."""

    total: int  # the device's memory
    in_use: int  # taken after loading and profiling: weights, workspaces, other processes
    weights: int  # parameters of the loaded models (part of in_use)
    activation_peak: int  # the largest step's activations + logits, over the cache (profiled)
    utilization: float  # the share of total this engine may take

    @property
    def kv_budget(self) -> int:
        """What is left for the KV cache: the allowed share, less what is already in use and
        the largest step's transient memory (which the cache must leave room for)."""
        return kv_budget_bytes(self.total, self.in_use, self.activation_peak, self.utilization)


def kv_budget_bytes(total: int, in_use: int, activation_peak: int, utilization: float) -> int:
    """int(total * utilization) - in_use - activation_peak, never below 0.

    Why each term: the engine may take `utilization` of the device; what is allocated now
    (weights, cuBLAS/Triton workspaces, other processes) is already spent; and every step
    allocates its activations and logits on top of the cache, so the profiled peak of the
    largest step must stay free or the first full batch runs out of memory."""
    assert total >= 0 and in_use >= 0 and activation_peak >= 0 and 0.0 < utilization <= 1.0
    return max(0, int(total * utilization) - in_use - activation_peak)


def measure_gpu_memory(device: torch.device, weights: int, activation_peak: int,
                       utilization: float) -> GpuMemoryPlan:
    """Read the device's free/total memory (after releasing the allocator's cached blocks:
    loading and profiling leave some that are not really in use)."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return GpuMemoryPlan(total, total - free, weights, activation_peak, utilization)


def plan_gpu_memory(runners: list[ModelRunner], utilization: float, max_num_tokens: int,
                    max_num_seqs: int, tokens_per_seq: int, max_seq_len: int) -> GpuMemoryPlan:
    """Profile each runner's largest step (before any real cache exists), then measure.

    Target and draft never run a step at the same time, so the larger of their peaks is what
    the cache must leave free."""
    peak = max(r.profile_peak_memory(max_num_tokens, max_num_seqs, tokens_per_seq, max_seq_len)
               for r in runners)
    # One container over all the models, so a tensor they share (a draft may share the
    # target's embedding) is counted once.
    weights = tensor_bytes(nn.ModuleList(r.model for r in runners))
    return measure_gpu_memory(runners[0].device, weights, peak, utilization)


def num_blocks_for_budget(cache: CacheConfig, per_block: int, device: torch.device,
                          max_useful_blocks: int,
                          plan: GpuMemoryPlan | None = None) -> int:
    """How many blocks the budget buys: an explicit override, a byte budget, or (CUDA) the
    plan's share of gpu_memory_utilization left after the weights and the profiled peak of
    the largest step (measured here without the peak when no plan is given)."""
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    if cache.kv_cache_memory_bytes is not None:
        budget = cache.kv_cache_memory_bytes
    elif device.type == "cuda":
        if plan is None:
            plan = measure_gpu_memory(device, 0, 0, cache.gpu_memory_utilization)
        budget = plan.kv_budget
        blocks = max(0, min(budget // per_block, max_useful_blocks))
        gib = 2**30
        logger.info("GPU memory: total %.2f GiB x utilization %.2f; in use %.2f GiB (weights "
                    "%.2f GiB); activation peak of the largest step %.2f GiB; KV budget %.2f GiB "
                    "-> %d blocks of %.2f MiB (%.2f GiB)", plan.total / gib, plan.utilization,
                    plan.in_use / gib, plan.weights / gib, plan.activation_peak / gib,
                    budget / gib, blocks, per_block / 2**20, blocks * per_block / gib)
        return blocks
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
