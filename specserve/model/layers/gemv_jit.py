"""Device code shared by the GEMV kernels: loading a weight tile (every GEMV), loading the
first one before the PDL wait (layers/pdl.py), and the one-row product that triton_ops' _gemv
and fused_mlp's _gate_up_silu both run (they differ only in which rows they take and what they
do with the sums).

Imported only where triton is (the kernel modules import it when they compile).
"""

from __future__ import annotations

import triton
import triton.language as tl

from specserve.model.layers import pdl_jit


@triton.jit
def weight_tile(w_rows, cols, row_mask, n_cols, EVEN: tl.constexpr,
                EVEN_COLS: tl.constexpr):
    """The weight tile [BLOCK_N, BLOCK_K] at rows w_rows [BLOCK_N, 1] and columns cols
    [BLOCK_K]; unless EVEN, rows not row_mask and columns >= n_cols read as 0. EVEN_COLS
    (only read when not EVEN): every column is in range, so only the rows are masked (the mask
    stays constant along K, so the loads stay vectorised)."""
    if EVEN:
        return tl.load(w_rows + cols[None, :])
    elif EVEN_COLS:
        return tl.load(w_rows + cols[None, :], mask=row_mask[:, None], other=0.0)
    else:
        return tl.load(w_rows + cols[None, :], mask=row_mask[:, None] & (cols < n_cols)[None, :],
                       other=0.0)


@triton.jit
def load_weights_then_wait(w_rows, cols, row_mask, n_cols, EVEN: tl.constexpr,
                           PDL: tl.constexpr, EVEN_COLS: tl.constexpr):
    """The peeled first block of a GEMV: its weight_tile, loaded BEFORE the PDL wait (weights
    are no earlier kernel's output), so with PDL they stream while the previous kernel
    drains; then pdl_jit.release_and_wait."""
    w = weight_tile(w_rows, cols, row_mask, n_cols, EVEN, EVEN_COLS)
    pdl_jit.release_and_wait(PDL)
    return w


@triton.jit
def one_row_sums(x_ptr, w_rows, row_mask, n_cols, EVEN: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr):
    """sum_k w[row, k] * x[k] in float32 for the weight rows at w_rows [BLOCK_N, 1] (rows not
    row_mask, and unless EVEN columns >= n_cols, read as 0) -> [BLOCK_N].

    One [BLOCK_N, BLOCK_K] float32 accumulator of plain FMAs, summed over K once at the end. The
    first BLOCK_K columns are peeled off the loop: their weights are loaded before the PDL wait
    (load_weights_then_wait), so with PDL they stream while the previous kernel
    finishes; acc starts as the first products, so the sums are those of the plain loop."""
    cols = tl.arange(0, BLOCK_K)
    w = load_weights_then_wait(w_rows, cols, row_mask, n_cols, EVEN, PDL, EVEN)
    if EVEN:
        x = tl.load(x_ptr + cols)
    else:
        x = tl.load(x_ptr + cols, mask=cols < n_cols, other=0.0)
    acc = w.to(tl.float32) * x.to(tl.float32)[None, :]  # [BLOCK_N, BLOCK_K]
    for k0 in range(BLOCK_K, n_cols, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        if EVEN:
            x = tl.load(x_ptr + cols)
        else:
            x = tl.load(x_ptr + cols, mask=cols < n_cols, other=0.0)
        w = weight_tile(w_rows, cols, row_mask, n_cols, EVEN, EVEN)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    return tl.sum(acc, axis=1)
