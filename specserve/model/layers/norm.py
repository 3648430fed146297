"""Normalisation layers matching Hugging Face numerics (RMSNorm computed in float32)."""

from __future__ import annotations

import torch
from torch import nn

from specserve.model.layers import cpu_kernels, triton_ops


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
        if self._cpu_kernel_fits(x):
            return cpu_kernels.load().rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x if dtype == torch.float32 else x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (x32 if dtype == torch.float32 else x32.to(dtype))

    def _cpu_kernel_fits(self, x: torch.Tensor) -> bool:
        """float32 rows on the CPU: one C++ pass (csrc/rms_norm.cpp) instead of 7 dispatches."""
        return (x.dim() == 2 and x.is_contiguous() and self.weight.dtype == torch.float32
                and cpu_kernels.available(x))

    def add_and_norm(self, x: torch.Tensor,
                     residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual [T, hidden] -> (norm(x + residual), x + residual).

        The residual add of a pre-norm decoder layer, fused with the norm that follows it into
        one kernel on CUDA and on the CPU in float32; elsewhere exactly the unfused ops (an add
        in x's dtype, then forward)."""
        if (triton_ops.available(x) and x.dim() == 2 and x.dtype == self.weight.dtype
                and residual.dtype == x.dtype and residual.shape == x.shape):
            return triton_ops.add_rms_norm(x, residual, self.weight, self.eps)
        if self._cpu_kernel_fits(x) and residual.shape == x.shape and residual.is_contiguous() \
                and residual.dtype == torch.float32:
            return tuple(cpu_kernels.load().add_rms_norm(x, residual, self.weight, self.eps))
        hidden = x + residual
        return self(hidden), hidden
