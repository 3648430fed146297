"""Host -> device copies that never make the host wait for the GPU.

A copy from ordinary (pageable) host memory is synchronous on CUDA: the host blocks until the
stream has drained, so a small index tensor built right after a forward pass was launched makes
the host sit idle through the whole forward, and the sampling set-up that follows cannot overlap
it. Staging through pinned memory makes the copy a queued DMA; PyTorch's caching host allocator
keeps the pinned block alive until the copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(data: Sequence | torch.Tensor, dtype: torch.dtype,
              device: torch.device | str) -> torch.Tensor:
    """A host list (or CPU tensor) as a tensor on `device`, copied without a host sync."""
    device = torch.device(device)
    host = data.to(dtype) if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
