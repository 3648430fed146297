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


def scatter_rows(values: torch.Tensor, rows: Sequence[int], total: int) -> torch.Tensor:
    """values [A, ...] as rows `rows` (increasing) of a zero tensor [total, ...] on its device.
    When the rows are all of 0 .. total - 1 that is values itself: no device work (a draft
    model's proposals for a batch in which every sequence proposes, the usual case)."""
    if len(rows) == total:  # increasing indices below total: exactly 0 .. total - 1
        return values
    out = values.new_zeros(total, *values.shape[1:])
    out[to_device(rows, torch.int64, values.device)] = values
    return out
