"""Small helpers the Triton kernels share: launch sizing and dtype-dependent choices."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


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



_pdl_default = False


def set_pdl(enabled: bool) -> None:
    """The process's choice for kernels launched without an explicit `pdl` (the engine sets it once, from
    its config, before capturing CUDA graphs)."""
    global _pdl_default
    _pdl_default = bool(enabled)


def pdl_launch(enabled: bool | None = None) -> dict:
    """Launch options for a kernel compiled with a `PDL` constexpr: {PDL, launch_pdl} where programmatic
    dependent launch is asked for (explicitly, or by set_pdl) and possible (compute capability >= 9, not
    the interpreter). Such a kernel calls griddepcontrol.wait before it reads anything an earlier kernel
    wrote (and before any early exit), so it may be scheduled while the previous grid drains: in a CUDA
    graph a kernel boundary stops costing a launch gap, and a GEMV starts streaming its weights early."""
    on = (_pdl_default if enabled is None else bool(enabled)) and pdl_supported()
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@functools.lru_cache(maxsize=None)
def pdl_supported() -> bool:
    return (not interpreting() and torch.cuda.is_available()
            and torch.cuda.get_device_capability()[0] >= 9)


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """First statement of a PDL-capable kernel: wait for the previous grid's writes, then let the next
    kernel launch. Unconditional (no program may exit before it), so completion stays transitive."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
