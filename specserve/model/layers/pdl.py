"""Programmatic dependent launch (PDL) for the Triton kernels of a CUDA decode step.

Why: a batch-1 decode step of an 8B model is ~300 kernels in a CUDA graph, and between two of
them the GPU drains: the last programs of one kernel finish on a few SMs while the next kernel
has not started, so the HBM stream a GEMV needs stops at every boundary (on an H200 the
GEMVs averaged 3.8 TB/s where the large gate_up reaches 4.2), and a one-program kernel such as
an RMSNorm leaves the memory system idle for its whole ~2 us. With PDL (Hopper and later) a
kernel launched with ``launch_pdl=True`` may start while the kernel before it is still running:
each kernel here releases its dependents as soon as it starts (``gdc_launch_dependents``), and
waits for everything before it to finish and be visible (``gdc_wait``) before it reads any
input or writes anything. What it does before the wait must not depend on earlier kernels: the
GEMVs load their first chunk of weights there, so the next projection's weights stream during
the previous kernel's tail.

Numerics do not change: the same operations in the same order, only started earlier.

Only launches made for a CUDA graph use it (``graph_launches``). Contract for a kernel taking a
``PDL`` constexpr: with PDL set, it calls ``gdc_wait`` before its first load of anything an
earlier kernel may write and before its first store; the device side is layers/pdl_jit.py
(``release_and_wait``; layers/gemv_jit.py's ``load_weights_then_wait`` for the GEMVs' peeled
first block).
The launch site passes ``**launch_options(tensor)``. ``SPECSERVE_PDL=0`` (or
``ENABLED = False`` before graphs are captured) turns it off; CPU tensors (the Triton
interpreter in tests) never use it. tests/test_sm90_compile.py compiles every such kernel for
sm_90 on the CPU and checks the contract in its PTX.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

#: Module switch, read at every launch (A/B timing in tests/gpu/check_fused_decode.py).
ENABLED = os.environ.get("SPECSERVE_PDL", "1") != "0"


@functools.cache
def _device_supports(index: int) -> bool:
    """Hopper (sm_90) or later, and a Triton that has the grid-dependency ops."""
    if torch.cuda.get_device_capability(index)[0] < 9:
        return False
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return True


_graph_launches = 0  # depth of graph_launches() blocks


@contextlib.contextmanager
def graph_launches():
    """Launches inside this block use PDL (the CUDA-graph capture wraps its warm-up runs and
    its capture in it). Eager launches do not: with PDL they measured slower on the host (the
    enforce_eager batch-1 path of an 8B model went from 105 to 53 tok/s on an H200), and
    asking torch whether the stream is capturing at every launch cost that path another
    ~12 us per kernel; eager steps are bound by the host, not by kernel boundaries."""
    global _graph_launches
    _graph_launches += 1
    try:
        yield
    finally:
        _graph_launches -= 1


def active(t: torch.Tensor) -> bool:
    return (_graph_launches > 0 and ENABLED and t.is_cuda
            and _device_supports(t.device.index or 0))


def launch_options(t: torch.Tensor) -> dict:
    """Keyword arguments for a launch of a kernel with a ``PDL`` constexpr, on t's device."""
    if active(t):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
