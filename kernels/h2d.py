"""Host-to-device copies that never make the CPU wait for the GPU.

A copy from pageable host memory is staged synchronously and queues behind the work already on the
stream, so building step N+1's inputs would stall until step N finishes, defeating overlap scheduling.
Pinned staging (from torch's caching host allocator, which keeps a block until its copy completes)
lets the copy be enqueued and the CPU move on.
"""
from __future__ import annotations

import numpy as np
import torch

# torch.tensor() reads a list of Python ints at ~50 ns an element, numpy at ~12: an 8k-token prefill pass
# converts five such lists (ids, positions, the slot table's rows, columns and slots), ~2 ms of host time
# before its first kernel on the CI machine, in the pass's time to first token.
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.bool: np.bool_, torch.float32: np.float32}


def _host(values, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values
    np_dtype = _NUMPY.get(dtype)
    if np_dtype is None:
        return torch.tensor(values, dtype=dtype)
    return torch.from_numpy(np.array(values, dtype=np_dtype))  # a copy: never the caller's array


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = _host(values, dtype)
    if host.dtype != dtype:
        host = host.to(dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
