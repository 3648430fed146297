"""The C++ suffix tree (csrc/suffix_tree.cpp), compiled once per machine with torch's extension
loader; suffix.py falls back to its Python tree when it is unavailable.

Why: suffix decoding's host work grows with every committed token (max_tree_depth tree steps
each) and every lookup, and in Python it was ~2 % of each decode step at batch 32 on the 2-core
Zen 3 CPU, where the policy rightly proposed nothing: "[suffix]" then ran slower than plain
decoding. The C++ tree is the same algorithm and proposes exactly the same tokens
(tests/test_suffix.py). It needs only a C++ compiler (no -march flags: it is scalar code) and
builds in a few seconds; ``SPECSERVE_CPU_KERNELS=0`` turns it off with the other C++ code.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

from specserve.model.layers import cpu_kernels

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "suffix_tree.cpp"


@functools.cache
def _build():
    try:
        from torch.utils.cpp_extension import load

        t0 = time.perf_counter()
        module = load(name="specserve_suffix_tree", sources=[str(_SOURCE)],
                      extra_cflags=["-O2"], verbose=False)
        logger.info("C++ suffix tree ready in %.1fs", time.perf_counter() - t0)
        return module
    except Exception as exc:  # a build failure must not stop suffix decoding
        logger.warning("the C++ suffix tree could not be built (%s); using the Python tree", exc)
        return None


def load():
    """The compiled module, or None (disabled with the CPU kernels, or it could not be built)."""
    return _build() if cpu_kernels.enabled() else None
