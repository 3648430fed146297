"""KV-cache sizing: the budget arithmetic (a pure function), the block count it buys, and the
profiling pass's dummy steps (on CPU they run but measure nothing, and leave no cache)."""

from __future__ import annotations

import pytest
import torch

from specserve.config import CacheConfig
from specserve.worker.kv_cache import GpuMemoryPlan, kv_budget_bytes, num_blocks_for_budget
from specserve.worker.model_runner import ModelRunner, SequenceRun

GiB = 2**30


def test_budget_reserves_weights_and_activation_peak():
    # 100 GiB device, 90% allowed, 20 GiB in use, 5 GiB peak step -> 65 GiB for the cache
    assert kv_budget_bytes(100 * GiB, 20 * GiB, 5 * GiB, 0.9) == 65 * GiB


def test_budget_never_negative():
    assert kv_budget_bytes(10 * GiB, 9 * GiB, 2 * GiB, 0.9) == 0


def test_plan_budget_matches_function():
    plan = GpuMemoryPlan(total=80 * GiB, in_use=17 * GiB, weights=16 * GiB,
                         activation_peak=3 * GiB, utilization=0.5)
    assert plan.kv_budget == kv_budget_bytes(80 * GiB, 17 * GiB, 3 * GiB, 0.5) == 20 * GiB


def test_blocks_from_plan_on_cuda_device_object():
    """The plan decides on CUDA (no device is touched when one is given); the useful maximum
    still caps it."""
    plan = GpuMemoryPlan(total=100 * GiB, in_use=20 * GiB, weights=16 * GiB,
                         activation_peak=5 * GiB, utilization=0.9)
    cache = CacheConfig(gpu_memory_utilization=0.9)
    per_block = 2**20
    cuda = torch.device("cuda")
    assert num_blocks_for_budget(cache, per_block, cuda, 10**9, plan) == 65 * 1024
    assert num_blocks_for_budget(cache, per_block, cuda, 1000, plan) == 1000


def test_explicit_budgets_ignore_the_plan():
    plan = GpuMemoryPlan(100 * GiB, 20 * GiB, 16 * GiB, 5 * GiB, 0.9)
    cuda = torch.device("cuda")
    assert num_blocks_for_budget(CacheConfig(num_gpu_blocks_override=7), 1, cuda, 100, plan) == 7
    by_bytes = CacheConfig(kv_cache_memory_bytes=10 * 2**20)
    assert num_blocks_for_budget(by_bytes, 2**20, cuda, 100, plan) == 10


def _bare_runner(path) -> ModelRunner:
    from specserve.model.loader import iter_weights, load_hf_config, resolve_model
    from specserve.model.registry import build_model

    source = resolve_model(str(path))
    model = build_model(load_hf_config(source), iter_weights(source), torch.float32,
                        torch.device("cpu"))
    return ModelRunner(model, torch.device("cpu"), torch.float32, block_size=4)


@pytest.mark.parametrize("max_seq_len", [16, 64])
def test_profile_pass_runs_and_leaves_no_cache(tiny_llama, max_seq_len):
    runner = _bare_runner(tiny_llama)
    ref = runner.model.compute_logits  # the pass must not replace model pieces
    # 40 prefill tokens (chunks of <= max_seq_len), then 3 sequences x 5 verify tokens
    assert runner.profile_peak_memory(40, 3, 5, max_seq_len) == 0  # nothing measured on CPU
    assert runner.num_blocks == 0 and runner.graphs is None
    assert runner.model.compute_logits == ref
    assert all(layer.k_cache.numel() == 0 for layer in runner.model.attention_layers())
    runner.init_kv_cache(8)  # the real cache binds as usual afterwards
    logits = runner.execute([SequenceRun([1, 2, 3], 0, [0], [0, 1, 2])])
    assert logits.shape == (3, runner.model.vocab_size)
