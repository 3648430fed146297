"""Row argmax of logits in two small Triton kernels (the greedy head of a CUDA decode step); on
the CPU, the C++ kernel of csrc/argmax.cpp.

Why: torch's argmax over one [1, 128256] row runs as a single block and took 38 us of the
batch-1 Llama-3-8B decode graph's ~4.2 ms on an H200 (tests/gpu/check_fused_decode.py). Here
stage 1 reduces BLOCK columns per program (many programs in parallel), stage 2 reduces the few
block winners of each row.

Same answer as torch.argmax on every input: ties go to the lowest index, and NaN ranks above
every number (the first NaN wins), as torch does; both stages apply that rule, and a block's
winner is its first best column, so the lowest block among equal winners holds the lowest index.
"""

from __future__ import annotations

import functools

import torch

from specserve.model.layers import cpu_kernels, triton_ops

#: Module-level switch (A/B timing); off = torch.argmax.
ENABLED = True
BLOCK = 4096  # columns per stage-1 program (128256 logits: 32 programs per row)
MAX_BLOCKS = 1024  # stage 2 holds one row's block winners: vocabularies up to 4M columns


@functools.cache
def _kernels():
    """Compiled on first use (CPU runs never import triton). The kernels resolve names from
    this module's globals, hence the global declarations (the helper _best too)."""
    global triton, tl, _best
    import triton
    import triton.language as tl

    @triton.jit
    def _best(vals, idx, ok):
        """(value, index) of the first best entry of vals [N] where ok: NaN first, then max."""
        is_nan = (vals != vals) & ok
        any_nan = tl.max(is_nan.to(tl.int32), 0) > 0
        key = tl.where(ok, vals, float("-inf"))
        key = tl.where(is_nan, float("-inf"), key)
        best = tl.max(key, 0)
        cand = tl.where(any_nan, is_nan, ok & (key == best))
        big = tl.full(idx.shape, 2**62, tl.int64)
        win = tl.min(tl.where(cand, idx, big), 0)
        value = tl.where(any_nan, float("nan"), best)
        return value, win

    @triton.jit
    def _argmax_blocks(x_ptr, val_ptr, idx_ptr, n_cols, stride_x, n_blocks,
                       BLOCK: tl.constexpr):
        """grid (rows, blocks): the first best column of x[row, block] -> val/idx [rows, blocks]."""
        row = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        cols = blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        value, win = _best(x, cols, ok)
        tl.store(val_ptr + row * n_blocks + blk, value)
        tl.store(idx_ptr + row * n_blocks + blk, win)

    @triton.jit
    def _argmax_rows(val_ptr, idx_ptr, out_ptr, n_blocks, BLOCK_B: tl.constexpr):
        """grid (rows,): the best of a row's block winners -> out[row] (int64)."""
        row = tl.program_id(0).to(tl.int64)
        b = tl.arange(0, BLOCK_B)
        ok = b < n_blocks
        vals = tl.load(val_ptr + row * n_blocks + b, mask=ok, other=0.0)
        idx = tl.load(idx_ptr + row * n_blocks + b, mask=ok, other=0)
        _, win = _best(vals, idx, ok)
        tl.store(out_ptr + row, win)

    return _argmax_blocks, _argmax_rows


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] (last dim contiguous) -> [R] int64, the index of each row's maximum."""
    rows, cols = x.shape
    assert x.stride(-1) == 1
    n_blocks = -(-cols // BLOCK)
    assert n_blocks <= MAX_BLOCKS
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    vals = torch.empty(rows, n_blocks, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, n_blocks, dtype=torch.int64, device=x.device)
    blocks_kernel, rows_kernel = _kernels()
    blocks_kernel[(rows, n_blocks)](x, vals, idx, cols, x.stride(0), n_blocks, BLOCK=BLOCK,
                                    num_warps=8)
    rows_kernel[(rows,)](vals, idx, out, n_blocks, BLOCK_B=max(16, triton_ops._pow2(n_blocks)),
                         num_warps=1)
    return out


def logits_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] -> [R] int64 argmax: the Triton kernels on CUDA (switch on), the C++
    kernel on the CPU (csrc/argmax.cpp: torch's took ~21 us per SmolLM2 row there), else
    torch."""
    if ENABLED and logits.dim() == 2 and logits.stride(-1) == 1 and logits.shape[1] > 0:
        if triton_ops.available(logits) and -(-logits.shape[1] // BLOCK) <= MAX_BLOCKS:
            return argmax(logits)
        if cpu_kernels.available(logits):
            return cpu_kernels.load().argmax_rows(logits)
    return logits.argmax(dim=-1)
