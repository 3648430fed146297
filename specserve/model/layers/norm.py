"""Normalisation layers matching Hugging Face numerics (RMSNorm computed in float32)."""

from __future__ import annotations

import torch
from torch import nn

from specserve.model.layers import triton_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]; like HF, normalise in float32 then scale in x's dtype.

        HF's exact op sequence; for float32 inputs the two dtype casts are skipped (each is
        still a dispatch, and there are 61 norms per step)."""
        if triton_ops.available(x) and x.dim() == 2 and x.dtype == self.weight.dtype:
            return triton_ops.rms_norm(x, self.weight, self.eps)  # one kernel instead of 7
        dtype = x.dtype
        x32 = x if dtype == torch.float32 else x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (x32 if dtype == torch.float32 else x32.to(dtype))

    def add_and_norm(self, x: torch.Tensor,
                     residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual [T, hidden] -> (norm(x + residual), x + residual).

        The residual add of a pre-norm decoder layer, fused with the norm that follows it into
        one kernel on CUDA; elsewhere exactly the unfused ops (an add in x's dtype, then
        forward)."""
        if (triton_ops.available(x) and x.dim() == 2 and x.dtype == self.weight.dtype
                and residual.dtype == x.dtype and residual.shape == x.shape):
            return triton_ops.add_rms_norm(x, residual, self.weight, self.eps)
        hidden = x + residual
        return self(hidden), hidden
