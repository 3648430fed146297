"""Rotary position embeddings (HF "rotate half" layout), with Llama 3 frequency scaling."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from specserve.model.layers import triton_ops


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's wavelength-dependent rescaling of the rotary frequencies."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _linear_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    return inv_freq / scaling["factor"]


_INV_FREQ_SCALERS = {"llama3": _llama3_inv_freq, "linear": _linear_inv_freq}


def rope_settings(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(base, scaling) from either transformers 5's ``rope_parameters`` or 4.x's
    ``rope_theta`` + ``rope_scaling``."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        rope_type = params.get("rope_type", params.get("type", "default"))
        return float(params["rope_theta"]), (None if rope_type == "default" else dict(params))
    return float(getattr(config, "rope_theta", 10000.0)), getattr(config, "rope_scaling", None)


class RotaryTable(NamedTuple):
    """One step's rotation factors, looked up once per forward and shared by all layers."""

    cos: torch.Tensor  # [T, 1, 1, rot/2] float32
    sin: torch.Tensor  # [T, 1, 2, rot/2] float32: -sin for the first half, +sin for the second


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin table indexed by absolute position."""

    def __init__(self, head_dim: int, max_position: int, base: float,
                 rope_scaling: dict[str, Any] | None = None, rotary_dim: int | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        inv_freq = 1.0 / (
            base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float64, device="cpu")
                     / self.rotary_dim)
        )
        rope_type = None
        if rope_scaling:
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
        if rope_type not in (None, "default"):
            if rope_type not in _INV_FREQ_SCALERS:
                raise ValueError(
                    f"rope_scaling type {rope_type!r} is not supported; supported: "
                    f"{sorted(_INV_FREQ_SCALERS)} (or none)."
                )
            inv_freq = _INV_FREQ_SCALERS[rope_type](inv_freq, rope_scaling)
        positions = torch.arange(max_position, dtype=torch.float64, device="cpu")
        freqs = torch.outer(positions, inv_freq).float()  # [max_pos, rot/2]
        # Plain attributes, not buffers: models are built on the meta device and materialised
        # with to_empty(), which would leave buffers uninitialised. Moved on first use.
        self.cos = freqs.cos()  # [max_pos, rot/2] float32
        self.sin = freqs.sin()
        # The sign pattern of "rotate half" folded into the table (see rotate).
        self.signed_sin = torch.stack((-self.sin, self.sin), dim=1)  # [max_pos, 2, rot/2]

    def table(self, positions: torch.Tensor) -> RotaryTable:
        """positions [T] -> this step's factors (one lookup per step, not per layer)."""
        if self.cos.device != positions.device:
            self.cos = self.cos.to(positions.device)
            self.sin = self.sin.to(positions.device)
            self.signed_sin = self.signed_sin.to(positions.device)
        return RotaryTable(self.cos[positions][:, None, None, :],
                           self.signed_sin[positions][:, None])

    def rotate(self, x: torch.Tensor, table: RotaryTable) -> torch.Tensor:
        """x [T, heads, D] -> rotated copy [T, heads, D] (HF "rotate half" layout).

        With x = [x1, x2] per head, HF computes [x1*cos - x2*sin, x2*cos + x1*sin]. Viewing the
        halves as an axis of 2, that is ``x * cos + swap(x) * [-sin, +sin]``: four whole-tensor
        ops and bit-identical to HF's (a negated product added equals the product subtracted).
        """
        if (self.rotary_dim == self.head_dim and triton_ops.available(x)
                and x.stride(-1) == 1):
            return triton_ops.rotary(x, table.cos, table.sin)  # one kernel instead of 6
        t, heads = x.shape[0], x.shape[1]
        rot = x if self.rotary_dim == self.head_dim else x[..., : self.rotary_dim]
        halves = rot.float().reshape(t, heads, 2, self.rotary_dim // 2)  # [T, h, 2, rot/2]
        rotated = halves * table.cos + halves.flip(2) * table.sin  # [T, h, 2, rot/2]
        rotated = rotated.view(t, heads, self.rotary_dim).to(x.dtype)
        if self.rotary_dim == self.head_dim:
            return rotated
        return torch.cat((rotated, x[..., self.rotary_dim :]), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T]; q: [T, H*D]; k: [T, KvH*D] -> rotated q, k (same shapes)."""
        table = self.table(positions)
        t = q.shape[0]
        return (self.rotate(q.view(t, num_heads, -1), table).reshape(t, -1),
                self.rotate(k.view(t, num_kv_heads, -1), table).reshape(t, -1))
