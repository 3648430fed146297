"""specserve's C++ CPU kernels (layers/csrc), compiled once per machine with torch's extension
loader; every caller falls back to plain torch ops when they are unavailable.

Why C++ at all: on a CPU a batch-1 decode step of a small model is bound by the bytes of weights
it reads and by per-op dispatch overhead, and torch has no op for either fix: float32 products
straight from GGUF's 4-bit blocks (csrc/gguf_linear.cpp, used by quantization/gguf_blocks.py), and
a residual add + RMSNorm in one pass instead of 7 dispatches (csrc/rms_norm.cpp, used by
layers/norm.py), rotary + KV-cache write in one pass instead of ~12 (csrc/rope_kv.cpp, used by
the torch attention backend). Each kernel computes the same float32 arithmetic as the torch ops it replaces,
up to summation order; tests/test_cpu_kernels.py compares them with those ops.

The build needs a C++ compiler (gcc is on every machine we run on) and takes ~40 s the first
time; the binary is cached under torch's extensions directory (``TORCH_EXTENSIONS_DIR``), keyed
by this CPU's instruction sets because it is compiled with ``-march=native``.
``SPECSERVE_CPU_KERNELS=0`` turns them all off (the pure torch reference path).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DISABLE_ENV = "SPECSERVE_CPU_KERNELS"
_CSRC = Path(__file__).with_name("csrc")
_SOURCES = ("bindings.cpp", "gguf_linear.cpp", "gguf_a8_linear.cpp", "gguf_amx_linear.cpp",
            "rms_norm.cpp", "rope_kv.cpp", "attention.cpp", "argmax.cpp", "activation.cpp")


def enabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1") != "0"


def _cpu_tag() -> str:
    """A short hash of the CPU's instruction sets: a shared build directory must never hand one
    machine a binary built with -march=native for another."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return hashlib.sha1(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


@functools.cache
def _build():
    try:
        from torch.utils.cpp_extension import load

        t0 = time.perf_counter()
        logger.info("loading specserve's CPU kernels (the first time on a machine compiles "
                    "them: ~40 s)")
        module = load(name=f"specserve_cpu_kernels_{_cpu_tag()}",
                      sources=[str(_CSRC / name) for name in _SOURCES],
                      extra_include_paths=[str(_CSRC)],
                      extra_cflags=["-O3", "-march=native", "-fopenmp"],
                      extra_ldflags=["-fopenmp"], verbose=False)
        logger.info("CPU kernels ready in %.1fs", time.perf_counter() - t0)
        return module
    except Exception as exc:  # a build failure must not stop a model from loading
        logger.warning("specserve's CPU kernels could not be built (%s); using torch ops", exc)
        return None


@functools.cache
def load():
    """The compiled module, or None (disabled, or it could not be built). Decided once per
    process: it is asked 61 times per decode step."""
    return _build() if enabled() else None


def available(x: torch.Tensor) -> bool:
    """True when x is a float32 CPU tensor and the kernels are loaded."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and load() is not None
