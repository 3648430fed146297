"""Pick the attention backend for a device (the one place that knows the choices)."""

from __future__ import annotations

import torch

from specserve.model.layers.attention.backend import AttentionBackend
from specserve.model.layers.attention.torch_backend import TorchAttentionBackend


def get_attention_backend(device: torch.device) -> AttentionBackend:
    # A Triton backend for CUDA slots in here; the torch path is correct everywhere.
    return TorchAttentionBackend()
