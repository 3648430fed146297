"""8-bit weights: weight-only (bfloat16 activations) and dynamic W8A8 (int8 activations).

* ``Int8WeightOnlyLinear``: int8 weights with one scale per output channel; torch's
  ``_weight_int8pack_mm`` kernel (bfloat16 activations). Used for output projections.
* ``int8`` method (W8A8): int8 weights per output channel *and* activations quantized to int8
  per token at run time, multiplied with ``torch._int_mm`` (integer accumulation, exact). Integer
  multiply-adds are 4x denser than fp32 on CPUs with VNNI, which is what batch throughput and
  prefill are bound by. Per-token (never per-batch) activation scales keep every row independent
  of its batch mates.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from specserve.model.layers.quantization.base import QuantizationMethod, copy_bias

_QMAX = 127


def _per_channel_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (codes [N, K] int8, scale [N] float32), symmetric."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / _QMAX).clamp(min=torch.finfo(torch.float32).tiny)  # [N]
    codes = torch.round(w / scale[:, None]).clamp(-_QMAX, _QMAX).to(torch.int8)
    return codes, scale


class Int8WeightOnlyLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        codes, scale = _per_channel_int8(linear.weight)
        self.register_buffer("weight_int8", codes)  # [N, K]
        self.register_buffer("scale", scale.to(torch.bfloat16))  # [N]
        self.bias = copy_bias(linear)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        y = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.weight_int8, self.scale)
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias


class DynamicInt8Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        codes, scale = _per_channel_int8(linear.weight)
        self.register_buffer("weight_t", codes.t().contiguous())  # [K, N] for _int_mm
        self.register_buffer("scale", scale)  # [N]
        self.bias = copy_bias(linear)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        # Few passes over [T, K] and [T, N]: elementwise work rivals the matmul at prefill.
        xf = x.float()
        x_scale = xf.abs().amax(dim=-1, keepdim=True).div_(_QMAX).clamp_(
            min=torch.finfo(torch.float32).tiny)  # [T, 1]
        x_int8 = torch.div(xf, x_scale).round_().to(torch.int8)  # [T, K]
        acc = torch._int_mm(x_int8, self.weight_t)  # [T, N] int32, exact
        # A mixed int32 * float32 mul takes a slow path; convert once, then scale in place.
        y = acc.to(torch.float32).mul_(self.scale).mul_(x_scale)  # [T, N]
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype)


class DynamicInt8(QuantizationMethod):
    name: ClassVar[str] = "int8"
    description: ClassVar[str] = ("8-bit weights per output channel and 8-bit activations per "
                                  "token (integer matmul); CPU")
    devices: ClassVar[frozenset[str]] = frozenset({"cpu"})

    def quantize_linear(self, linear: nn.Linear, role: str, name: str) -> nn.Module | None:
        return DynamicInt8Linear(linear)
