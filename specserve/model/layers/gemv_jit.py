"""Device code shared by the one-row GEMV kernels (triton_ops' _gemv and fused_mlp's
_gate_up_silu): both stream a [BLOCK_N, K] slab of weight rows against one row of x and differ
only in which rows they take and what they do with the sums.

Imported only where triton is (the kernel modules import it when they compile).
"""

from __future__ import annotations

import triton
import triton.language as tl

from specserve.model.layers import pdl_jit


@triton.jit
def one_row_sums(x_ptr, w_rows, row_mask, n_cols, EVEN: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr):
    """sum_k w[row, k] * x[k] in float32 for the weight rows at w_rows [BLOCK_N, 1] (rows not
    row_mask, and unless EVEN columns >= n_cols, read as 0) -> [BLOCK_N].

    One [BLOCK_N, BLOCK_K] float32 accumulator of plain FMAs, summed over K once at the end. The
    first BLOCK_K columns are peeled off the loop: their weights are loaded before the PDL wait
    (pdl_jit.load_weights_then_wait), so with PDL they stream while the previous kernel
    finishes; acc starts as the first products, so the sums are those of the plain loop."""
    cols = tl.arange(0, BLOCK_K)
    w = pdl_jit.load_weights_then_wait(w_rows, cols, row_mask, n_cols, EVEN, PDL)
    if EVEN:
        x = tl.load(x_ptr + cols)
    else:
        x = tl.load(x_ptr + cols, mask=cols < n_cols, other=0.0)
    acc = w.to(tl.float32) * x.to(tl.float32)[None, :]  # [BLOCK_N, BLOCK_K]
    for k0 in range(BLOCK_K, n_cols, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        if EVEN:
            x = tl.load(x_ptr + cols)
            w = tl.load(w_rows + cols[None, :])
        else:
            col_mask = cols < n_cols
            x = tl.load(x_ptr + cols, mask=col_mask, other=0.0)
            w = tl.load(w_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :],
                        other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    return tl.sum(acc, axis=1)
