"""Bring a tensor into L2 ahead of the kernel that reads it: Hopper's bulk L2 prefetch.

Each program issues `cp.async.bulk.prefetch.L2.global` (sm_90) for CHUNK-byte pieces of the tensor: the memory
system fetches them into L2 with nothing for the program to wait on, so the kernel ends as soon as they are
issued. Nothing it reads is an earlier kernel's output, so launched under PDL it lets the next kernel launch at
once and waits for the previous one only at its end: its completion still implies the previous kernel's, which
the kernels after it rely on (kernels/_utils.py). The engine launches it on a side stream instead
(shared/models/weight_prefetch.py), beside the kernels it is meant to hide under.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels._utils import interpreting, pdl_launch, pdl_trigger, pdl_wait

CHUNK = 8192  # bytes a prefetch instruction covers (a multiple of 16)
PER_PROGRAM = 128  # chunks a program issues: one a thread at four warps


@triton.jit
def _l2_prefetch_kernel(P, nbytes, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr, PDL: tl.constexpr):
    pdl_trigger(PDL)
    offs = (tl.program_id(0) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)).to(tl.int64) * CHUNK
    size = tl.minimum(tl.maximum(nbytes - offs, 0), CHUNK).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [P + offs, size], dtype=tl.int32, is_pure=False, pack=1)
    pdl_wait(PDL)


@functools.lru_cache(maxsize=None)
def supported(device_index: int) -> bool:
    """Bulk L2 prefetch needs sm_90 or newer; the interpreter has no inline assembly."""
    return not interpreting() and torch.cuda.get_device_capability(device_index)[0] >= 9


def l2_prefetch(t: torch.Tensor, pdl: bool | None = None) -> None:
    """Ask for the contiguous tensor t to be brought into L2 (a hint: the result of no kernel depends on it).
    A no-op off CUDA and before Hopper."""
    if t.is_cuda and supported(t.device.index if t.device.index is not None else torch.cuda.current_device()):
        launch(t, pdl)


def launch(t: torch.Tensor, pdl: bool | None = None) -> None:
    assert t.is_contiguous() and t.data_ptr() % 16 == 0
    nbytes = t.numel() * t.element_size()
    if nbytes:
        grid = (triton.cdiv(triton.cdiv(nbytes, CHUNK), PER_PROGRAM),)
        _l2_prefetch_kernel[grid](t.reshape(-1).view(torch.uint8), nbytes, CHUNK=CHUNK, PER_PROGRAM=PER_PROGRAM,
                                  num_warps=4, **pdl_launch(pdl, "prefetch"))
