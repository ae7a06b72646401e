"""Host-to-device copies that never make the CPU wait for the GPU.

A copy from pageable host memory is staged synchronously and queues behind the work already on the
stream, so building step N+1's inputs would stall until step N finishes, defeating overlap scheduling.
Pinned staging (from torch's caching host allocator, which keeps a block until its copy completes)
lets the copy be enqueued and the CPU move on.
"""
from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if host.dtype != dtype:
        host = host.to(dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
