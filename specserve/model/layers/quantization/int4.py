"""4-bit weights, groups of 32 along the input dimension, asymmetric (scale and zero per group).

This is the layout of GGUF's Q4_1 blocks: a Q4_1 checkpoint such as the SmolLM2 GGUF we ship with
comes back to exactly its stored 4-bit codes (only the group scale/zero are rounded to bfloat16,
which the kernel needs). Kernel: torch's ``_weight_int4pack_mm_for_cpu``, which wants bfloat16
activations; each output row depends only on its input row (batch invariant).

The output projection is kept at 8 bits per weight (per output channel): it decides the argmax
over the whole vocabulary and is where 4-bit rounding would be most visible (GGUF files keep it
at Q8_0 or better for the same reason).
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.model.layers.quantization.base import LM_HEAD_ROLE, QuantizationMethod, copy_bias
from specserve.model.layers.quantization.int8 import Int8WeightOnlyLinear

GROUP_SIZE = 32
_LEVELS = 15  # 4-bit codes 0..15
_CENTER = 8  # the kernel dequantizes (code - 8) * scale + zero


class Int4WeightOnlyLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()  # [N, K]
        n, k = weight.shape
        groups = weight.reshape(n, k // GROUP_SIZE, GROUP_SIZE)  # [N, K/G, G]
        lo, hi = groups.amin(-1), groups.amax(-1)  # [N, K/G]
        scale = ((hi - lo) / _LEVELS).clamp(min=torch.finfo(torch.float32).tiny)  # [N, K/G]
        codes = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, _LEVELS)
        codes = codes.to(torch.int32).reshape(n, k)  # [N, K]
        zero = lo + _CENTER * scale  # value of code 8
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        # [K/G, N, 2]: (scale, zero) per group, the kernel's layout
        self.register_buffer("scales_and_zeros", torch.stack([scale, zero], -1)
                             .transpose(0, 1).contiguous().to(torch.bfloat16))
        self.bias = copy_bias(linear)
        self.in_features, self.out_features = k, n

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed, GROUP_SIZE, self.scales_and_zeros).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={GROUP_SIZE}"


class Int4WeightOnly(QuantizationMethod):
    name = "int4"
    description = ("4-bit weights in groups of 32 (GGUF Q4_1 layout, exact for Q4_1 files), "
                   "8-bit output projection, bfloat16 activations; CPU")
    devices = frozenset({"cpu"})

    def quantize_linear(self, linear: nn.Linear, role: str, name: str) -> nn.Module | None:
        if role == LM_HEAD_ROLE:
            return Int8WeightOnlyLinear(linear)
        n, k = linear.weight.shape
        if k % GROUP_SIZE or n % 8:
            return None  # the packed layout needs whole groups along K
        return Int4WeightOnlyLinear(linear)
