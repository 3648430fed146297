"""Pick the attention backend for a device (the one place that knows the choices).

CUDA gets the Triton backend when triton imports, anything else the torch reference. The
environment variable SPECSERVE_ATTENTION_BACKEND=torch|triton forces one (``triton`` on a CPU
device only runs under TRITON_INTERPRET=1, which is how the kernels are tested).
"""

from __future__ import annotations

import logging
import os

import torch

from specserve.model.layers.attention.backend import AttentionBackend
from specserve.model.layers.attention.torch_backend import TorchAttentionBackend

logger = logging.getLogger(__name__)
ENV_VAR = "SPECSERVE_ATTENTION_BACKEND"


def get_attention_backend(device: torch.device) -> AttentionBackend:
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced not in ("", "torch", "triton"):
        raise ValueError(f"{ENV_VAR} must be 'torch' or 'triton', got {forced!r}")
    if forced == "torch" or (not forced and torch.device(device).type != "cuda"):
        return TorchAttentionBackend()
    try:
        from specserve.model.layers.attention.triton_backend import TritonAttentionBackend
    except ImportError as exc:
        if forced:
            raise ImportError(f"{ENV_VAR}=triton but triton cannot be imported: {exc}") from exc
        logger.warning("triton is not importable (%s); using the torch attention backend", exc)
        return TorchAttentionBackend()
    return TritonAttentionBackend()
