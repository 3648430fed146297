"""The Triton attention backend against the torch reference, on CPU under the Triton interpreter.

The interpreter must be chosen before triton is first imported (``triton.language``'s own
helpers are decorated at import time) and stay on while kernels run (constexpr helpers read it at
call time). So this module sets TRITON_INTERPRET=1 for the rest of the pytest process when
triton has not been imported yet (nothing else in the suite uses triton, and the variable only
affects triton). If something imported triton earlier without it, the kernel tests here skip and
one test re-runs this file in a fresh interpreter process instead. Shapes are small: the
interpreter runs every program in numpy.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
IN_PROCESS = os.environ.get("TRITON_INTERPRET") == "1"
triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from specserve.model.layers.attention import triton_kernels  # noqa: E402

if IN_PROCESS and type(triton_kernels.paged_attention_kernel).__name__ != "InterpretedFunction":
    importlib.reload(triton_kernels)  # imported earlier as compiled kernels: decorate again

from specserve.model.layers.attention.metadata import AttentionMetadata  # noqa: E402
from specserve.model.layers.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from specserve.model.layers.attention.triton_backend import TritonAttentionBackend  # noqa: E402

BLOCK_SIZE = 16
needs_interpreter = pytest.mark.skipif(
    not IN_PROCESS, reason="triton was imported before TRITON_INTERPRET=1 could be set; "
    "test_kernels_in_fresh_interpreter_process runs these instead")
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _make_batch(runs: list[tuple[int, int]], kv_heads: int, head_dim: int, num_heads: int,
                dtype: torch.dtype, seed: int = 0):
    """runs: (cached context before this step, query length) per sequence. Returns the metadata,
    caches holding random context for the cached part, and this step's q/k/v. Block tables are
    a random permutation of the pool, so no sequence's blocks are contiguous."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [ctx + q for ctx, q in runs]
    blocks_per_seq = [(s + BLOCK_SIZE - 1) // BLOCK_SIZE for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks hold junk that must never be read
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots, used = [], [], 0
    for (ctx, q), nb in zip(runs, blocks_per_seq, strict=True):
        table = perm[used:used + nb]
        used += nb
        tables.append(table)
        slots.extend(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                     for p in range(ctx, ctx + q))
    max_blocks = max(blocks_per_seq)
    padded = [t + [0] * (max_blocks - len(t)) for t in tables]

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    cache_shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    k_cache, v_cache = rand(*cache_shape), rand(*cache_shape)
    query_lens = [q for _, q in runs]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    num_tokens = starts[-1]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor(padded, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        query_lens=query_lens,
        seq_lens_host=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=BLOCK_SIZE,
    )
    q = rand(num_tokens, num_heads, head_dim)
    k = rand(num_tokens, kv_heads, head_dim)
    v = rand(num_tokens, kv_heads, head_dim)
    return meta, k_cache, v_cache, q, k, v


def _run(backend, meta, k_cache, v_cache, q, k, v):
    """A copy of the caches, the step's K/V written by the backend, then its attention."""
    meta = AttentionMetadata(**{**meta.__dict__, "backend_state": {}})
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    backend.prepare(meta)
    backend.write_kv(k, v, k_cache, v_cache, meta)
    out = backend.forward(q, k_cache, v_cache, meta, q.shape[-1] ** -0.5)
    return out, k_cache, v_cache


def _naive(meta, k_cache, v_cache, q, scale):
    """Float64, one sequence and one head at a time, straight from the definition."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[2]
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens, meta.seq_lens_host, strict=True)):
        slots = [int(meta.block_tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                 for p in range(seq_len)]
        k = k_cache.view(-1, *k_cache.shape[2:])[slots].double()  # [K, KvH, D]
        v = v_cache.view(-1, *v_cache.shape[2:])[slots].double()
        start = int(meta.query_start_loc[i])
        qs = q[start:start + q_len].double().transpose(0, 1)  # [H, Q, D]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, K, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]  # [Q, 1]
        w = (qs @ k.transpose(1, 2) * scale).masked_fill(torch.arange(seq_len) > q_pos,
                                                         float("-inf"))  # [H, Q, K]
        out[start:start + q_len] = (torch.softmax(w, -1) @ v).transpose(0, 1)
    return out


def _check(runs, *, num_heads=4, kv_heads=2, head_dim=16, dtype=torch.float32, splits=None,
           seed=0, sdpa_prefill=True, tile_config=None):
    batch = _make_batch(runs, kv_heads, head_dim, num_heads, dtype, seed)
    ref, ref_k, ref_v = _run(TorchAttentionBackend(), *batch)
    out, out_k, out_v = _run(TritonAttentionBackend(num_splits=splits, num_sms=4,
                                                    sdpa_prefill=sdpa_prefill,
                                                    tile_config=tile_config), *batch)
    assert torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v), "KV write differs"
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max abs error {err:.3g} vs torch backend for {runs}"
    exact = _naive(batch[0], out_k, out_v, batch[3], batch[3].shape[-1] ** -0.5)
    err64 = (out.double() - exact).abs().max().item()
    assert err64 <= TOLERANCE[dtype], f"max abs error {err64:.3g} vs float64 for {runs}"
    return err, err64


# ---- decode, verification, prefill chunks (fp32) -------------------------------------------


@pytest.mark.parametrize("group", [1, 2, 4])
@needs_interpreter
def test_decode_gqa_groups(group):
    # Contexts span several non-contiguous blocks; one ends exactly on a block boundary.
    _check([(37, 1), (63, 1), (5, 1)], num_heads=2 * group, kv_heads=2)


@needs_interpreter
def test_verify_runs_of_different_lengths():
    # [last token] + k proposals, k = 1..8, in one batch (q_len 2..9), group 4.
    runs = [(20 + 7 * k, k + 1) for k in range(1, 9)]
    _check(runs, num_heads=8, kv_heads=2)


@needs_interpreter
def test_mixed_batch_decode_verify_and_prefill_chunk():
    # A prefill chunk over a cached prefix is tiled along the query (70 tokens x group 2 rows >
    # one tile), next to decodes and a verification run.
    _check([(50, 70), (33, 1), (17, 5), (0, 3)], num_heads=4, kv_heads=2)


@needs_interpreter
def test_prefill_chunk_continuing_cached_context_head_dim_64():
    _check([(45, 70)], num_heads=8, kv_heads=2, head_dim=64)


@needs_interpreter
def test_whole_prompts_several_sequences_use_the_kernel():
    _check([(0, 19), (0, 33)], num_heads=4, kv_heads=1)


@pytest.mark.parametrize("sdpa_prefill", [True, False])
@needs_interpreter
def test_single_whole_prompt(sdpa_prefill):
    _check([(0, 37)], num_heads=4, kv_heads=2, sdpa_prefill=sdpa_prefill)


@pytest.mark.parametrize("splits", [2, 3, 7])
@needs_interpreter
def test_split_context(splits):
    # More splits than some sequences have chunks: empty splits must merge away cleanly.
    _check([(200, 1), (30, 4), (129, 9)], num_heads=8, kv_heads=2, splits=splits)


@needs_interpreter
def test_split_count_heuristic_splits_long_single_sequence():
    backend = TritonAttentionBackend(num_sms=132)
    meta = _make_batch([(600, 3)], 2, 16, 8, torch.float32)[0]
    backend.prepare(meta)
    shape = backend._launch_shape(meta.backend_state["triton"], num_heads=8, kv_heads=2)
    assert shape.num_splits == 5 and shape.q_tiles == 1  # 603 keys / 128 per split
    _check([(600, 3)], num_heads=8, kv_heads=2)  # the heuristic's own choice, end to end


@pytest.mark.parametrize("block_n", [16, 32, 128])
@needs_interpreter
def test_keys_per_iteration(block_n):
    # Chunks smaller than, equal to and spanning several 16-token pages; splits cut them too.
    config = {rows: (block_n, 4, 2) for rows in (16, 32, 64, 128)}
    _check([(150, 1), (61, 7), (20, 40)], num_heads=4, kv_heads=2, splits=3,
           tile_config=config)


@needs_interpreter
def test_head_dim_64_gqa_verify_with_splits():
    _check([(90, 6), (10, 2)], num_heads=4, kv_heads=1, head_dim=64, splits=2)


# ---- half precision -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@needs_interpreter
def test_half_precision(dtype):
    _check([(40, 1), (25, 6), (70, 3)], num_heads=8, kv_heads=2, dtype=dtype, splits=2)


@needs_interpreter
def test_negative_slots_are_skipped():
    meta, k_cache, v_cache, q, k, v = _make_batch([(10, 2)], 2, 16, 4, torch.float32)
    meta.slot_mapping[1] = -1
    before = k_cache.clone()
    TritonAttentionBackend(num_sms=4).write_kv(k, v, k_cache, v_cache, meta)
    flat = k_cache.view(-1, 2, 16)
    slot0 = int(meta.slot_mapping[0])
    assert torch.equal(flat[slot0], k[0])
    flat_before = before.view(-1, 2, 16)
    changed = (flat != flat_before).any(dim=(1, 2)).nonzero().flatten().tolist()
    assert changed == [slot0]


@pytest.mark.skipif(IN_PROCESS, reason="the kernel tests above already ran interpreted")
def test_kernels_in_fresh_interpreter_process():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             __file__], env=env, capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


# ---- backend selection ------------------------------------------------------------------------


def test_selector_env_var(monkeypatch):
    from specserve.model.layers.attention.selector import get_attention_backend

    cpu = torch.device("cpu")
    monkeypatch.delenv("SPECSERVE_ATTENTION_BACKEND", raising=False)
    assert get_attention_backend(cpu).name == "torch"  # CPU default
    monkeypatch.setenv("SPECSERVE_ATTENTION_BACKEND", "triton")
    assert get_attention_backend(cpu).name == "triton"  # forced (runs interpreted on CPU)
    monkeypatch.setenv("SPECSERVE_ATTENTION_BACKEND", "torch")
    assert get_attention_backend(torch.device("cuda")).name == "torch"
    monkeypatch.setenv("SPECSERVE_ATTENTION_BACKEND", "cudnn")
    with pytest.raises(ValueError, match="SPECSERVE_ATTENTION_BACKEND"):
        get_attention_backend(cpu)
