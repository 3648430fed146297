"""The Triton side of programmatic dependent launch (layers/pdl.py): the device function every
kernel with a ``PDL`` constexpr calls, so that the release-and-wait order lives in one place
(the GEMVs reach it through layers/gemv_jit.py's load_weights_then_wait).

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

