"""Weight quantization applied after loading: one ABC, one class per method.

Why after loading: every checkpoint format we read (safetensors, .bin, GGUF) is first turned into
float weights by the loader, so a method only has to know how to turn an ``nn.Linear`` into a
cheaper module. On a CPU a decode step is bound by the bytes of weights it reads (fp32 SmolLM2
reads ~540 MB per token); 4-bit weights read 8x fewer.

Quantized modules keep the model's activation dtype at their boundaries, so the rest of the
network (norms, rotary, attention, sampling) is untouched. Every method here computes each output
row from its own input row only (per-row activation handling, no batch-wide scales), so results
do not depend on batch mates and speculative verification stays token-for-token equal to plain
decoding *within* a quantized model.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import nn

from specserve.model.base import tensor_bytes

logger = logging.getLogger(__name__)

# Roles a linear layer plays; the output projection is the most sensitive to rounding.
DECODER_ROLE = "decoder"
LM_HEAD_ROLE = "lm_head"


def copy_bias(linear: nn.Linear) -> nn.Parameter | None:
    """A frozen copy of ``linear``'s bias for its quantized replacement, or None if it has none.

    Assign it to ``self.bias`` so it is registered as a parameter (bias stays in float; only the
    weight is quantized)."""
    if linear.bias is None:
        return None
    return nn.Parameter(linear.bias.detach().clone(), requires_grad=False)


class QuantizationMethod(ABC):
    """Turns float ``nn.Linear`` layers into quantized modules with the same call signature."""

    name: ClassVar[str]
    description: ClassVar[str]
    devices: ClassVar[frozenset[str]]  # device types whose kernels this method uses

    def check_device(self, device: torch.device) -> None:
        if device.type not in self.devices:
            raise ValueError(
                f"quantization={self.name!r} is not available on {device.type} (its kernels run "
                f"on: {', '.join(sorted(self.devices))}). Leave quantization unset there.")

    def bind(self, model: nn.Module, source) -> None:
        """Called once before any ``quantize_linear``, with the model and the ``ModelSource`` it
        was loaded from: a method that reads the checkpoint itself (``gguf``) looks there."""
        del model, source  # most methods need only the float weights

    @abstractmethod
    def quantize_linear(self, linear: nn.Linear, role: str, name: str) -> nn.Module | None:
        """A replacement module for ``linear`` (module path ``name`` in the model), or None to
        keep it as it is (e.g. a shape the kernel cannot take)."""


def quantize_model(model: nn.Module, method: QuantizationMethod, device: torch.device,
                   source=None) -> int:
    """Replace the model's linear layers in place; returns how many were quantized."""
    method.check_device(device)
    method.bind(model, source)
    replaced = kept = 0
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            full_name = f"{parent_name}.{child_name}" if parent_name else child_name
            role = LM_HEAD_ROLE if full_name == "lm_head" else DECODER_ROLE
            new = method.quantize_linear(child, role, full_name)
            if new is None:
                kept += 1
                continue
            setattr(parent, child_name, new)
            replaced += 1
    logger.info("quantization=%s: %d linear layers quantized, %d kept in float; weights now %.1f "
                "MiB", method.name, replaced, kept, tensor_bytes(model) / 2**20)
    return replaced
