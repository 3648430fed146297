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


INDEX_CACHE_SIZE = 256  # distinct index lists kept on the device (then the cache starts over)
_index_cache: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}


def index_tensor(rows: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """rows as an int64 index tensor on `device`, made once per distinct list and reused:
    never write into it. Why: a step's row indices (which packed rows hold proposals, which
    rows need logits) follow the batch's shape and repeat step after step, and each fresh copy
    (a tensor built from a list, pinned, copied) cost ~30-50 us of host time on the H200 host,
    several per speculative step, on the path that keeps the GPU waiting."""
    device = torch.device(device)
    key = (device, tuple(rows))
    index = _index_cache.get(key)
    if index is None:
        if len(_index_cache) >= INDEX_CACHE_SIZE:
            _index_cache.clear()
        index = _index_cache[key] = to_device(key[1], torch.int64, device)
    return index


def scatter_rows(values: torch.Tensor, rows: Sequence[int], total: int) -> torch.Tensor:
    """values [A, ...] as rows `rows` (increasing) of a zero tensor [total, ...] on its device.
    When the rows are all of 0 .. total - 1 that is values itself: no device work (a draft
    model's proposals for a batch in which every sequence proposes, the usual case)."""
    if len(rows) == total:  # increasing indices below total: exactly 0 .. total - 1
        return values
    out = values.new_zeros(total, *values.shape[1:])
    out[index_tensor(rows, values.device)] = values
    return out


class PendingRead:
    """A device tensor's values on their way to the host, read later without waiting for work
    queued after this point. Why: ``tensor.tolist()`` copies in stream order, so a read issued
    after the next pass was launched waits for that pass too (on the H200 that made batch-32
    plain decoding with its next pass queued before the read 0.82x the speed of launching it
    after the read, BENCHMARKS.md session 23). Here the copy into pinned memory and an event
    are queued now; ``tolist`` waits on that event only."""

    def __init__(self, values: torch.Tensor) -> None:
        if values.is_cuda:
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._ready: torch.cuda.Event | None = torch.cuda.Event()
            self._ready.record()
        else:  # a CPU tensor is computed already (copied: the caller may reuse its buffer)
            self._host, self._ready = values.clone(), None

    def tolist(self) -> list:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()
