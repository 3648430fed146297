"""Row-wise argmax of logits for the greedy path, as a two-stage Triton reduction on CUDA.

Why: a greedy decode step at batch 1 ends in ``logits.argmax(-1)`` over one row of 128k
vocabulary entries; torch reduces a single row with one thread block, ~37 us on an H200 (about
1 % of a Llama-3-8B decode step). Splitting the row over many programs (stage 1: each chunk's
max and its first index) and merging the partials (stage 2) takes a few microseconds.

Semantics are torch's: the index of the first maximal value (ties go to the lowest index),
compared in the logits' own dtype. (NaN logits are not handled like torch's argmax, which
returns a NaN's index; a model producing NaN logits is broken either way.)
"""

from __future__ import annotations

import functools

import torch

from specserve.model.layers import triton_ops

CHUNK = 4096  # vocabulary entries per stage-1 program
MAX_CHUNKS = 1024  # stage 2 holds one row's partials in registers: vocab <= 4M


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [T, V] -> [T] int64 index of each row's first maximum."""
    num_rows, vocab = logits.shape
    chunks = -(-vocab // CHUNK)
    if not triton_ops.available(logits) or num_rows == 0 or chunks > MAX_CHUNKS:
        return logits.argmax(dim=-1)
    return triton_argmax(logits)


def triton_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The Triton path of argmax (also what the CPU tests run under the interpreter)."""
    num_rows, vocab = logits.shape
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    chunks = -(-vocab // CHUNK)
    part_max = torch.empty(num_rows, chunks, dtype=torch.float32,
                           device=logits.device)  # [T, chunks]
    part_idx = torch.empty(num_rows, chunks, dtype=torch.int64, device=logits.device)
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)  # [T]
    stage1, stage2 = _kernels()
    stage1[(num_rows, chunks)](logits, part_max, part_idx, logits.stride(0), vocab, chunks,
                               CHUNK=CHUNK, num_warps=4)
    stage2[(num_rows,)](part_max, part_idx, out, chunks,
                        BLOCK=max(16, 1 << (chunks - 1).bit_length()), num_warps=1)
    return out


@functools.cache
def _kernels():
    global triton, tl
    import triton
    import triton.language as tl

    @triton.jit
    def _chunk_argmax(x_ptr, max_ptr, idx_ptr, stride_x, vocab, chunks, CHUNK: tl.constexpr):
        """One chunk of one row: its maximum (as float32: exact for bf16/fp16/fp32 inputs) and
        the first index holding it."""
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < vocab, other=float("-inf"))
        x = x.to(tl.float32)
        best = tl.max(x, axis=0)
        # first index of the maximum: the smallest column whose value equals it
        first = tl.min(tl.where(x == best, cols, vocab), axis=0)
        tl.store(max_ptr + row * chunks + chunk, best)
        tl.store(idx_ptr + row * chunks + chunk, first.to(tl.int64))

    @triton.jit
    def _merge(max_ptr, idx_ptr, out_ptr, chunks, BLOCK: tl.constexpr):
        """A row's partials -> the first index of its maximum (chunks are in column order,
        so the lowest index among equal maxima is the smallest partial index)."""
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        mask = c < chunks
        m = tl.load(max_ptr + row * chunks + c, mask=mask, other=float("-inf"))
        i = tl.load(idx_ptr + row * chunks + c, mask=mask, other=0)
        best = tl.max(m, axis=0)
        big = 1 << 62
        first = tl.min(tl.where(mask & (m == best), i, big), axis=0)
        tl.store(out_ptr + row, first)

    return _chunk_argmax, _merge
