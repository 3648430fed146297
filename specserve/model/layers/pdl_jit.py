"""The Triton side of programmatic dependent launch (layers/pdl.py): the device functions every
kernel with a ``PDL`` constexpr calls, so that the release-and-wait order lives in one place.

Imported only where triton is (the kernel modules import it when they compile); CPU runs never
import this module.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def release_and_wait(PDL: tl.constexpr):
    """With PDL: let the next kernel start launching now, then wait until every kernel before
    this one has finished and its writes are visible. Call before the first load of anything an
    earlier kernel may write and before the first store; a no-op without PDL."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def load_weights_then_wait(w_rows, cols, row_mask, n_cols, EVEN: tl.constexpr,
                           PDL: tl.constexpr):
    """The peeled first block of a GEMV: w_rows [BLOCK_N, 1] row pointers, cols [BLOCK_K] the
    first columns -> weight tile [BLOCK_N, BLOCK_K] (zeros off the rows/columns unless EVEN),
    loaded BEFORE the PDL wait (weights are no earlier kernel's output), so with PDL they
    stream while the previous kernel drains; then release_and_wait."""
    if EVEN:
        w = tl.load(w_rows + cols[None, :])
    else:
        w = tl.load(w_rows + cols[None, :], mask=row_mask[:, None] & (cols < n_cols)[None, :],
                    other=0.0)
    release_and_wait(PDL)
    return w
