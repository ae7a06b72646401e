"""Small helpers the Triton kernels share: launch sizing and dtype-dependent choices."""
from __future__ import annotations

import functools
import os

import torch


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def interpreting() -> bool:
    """True when Triton runs kernels in its numpy interpreter (CPU tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_usable(device: torch.device | str) -> bool:
    """Triton kernels can run on this device: a GPU, or the CPU under the interpreter."""
    return torch.device(device).type == "cuda" or interpreting()


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int | None = None) -> int:
    """Multiprocessor count; a fixed small number on CPU so interpreted launches stay cheap."""
    if not torch.cuda.is_available():
        return 4
    idx = torch.cuda.current_device() if device_index is None else device_index
    return torch.cuda.get_device_properties(idx).multi_processor_count


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would otherwise run as tf32 on tensor cores and miss fp32 tolerances.
    return "ieee" if dtype == torch.float32 else "tf32"
