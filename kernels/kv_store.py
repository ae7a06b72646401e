"""Scatter the new tokens' K and V into their pool slots, casting to the pool dtype on the way."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._utils import next_pow2


@triton.jit
def _store_kv_kernel(K, V, KB, VB, LOC, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_bs, stride_bh, H, D, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(LOC + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    dst = slot * stride_bs + offs_h[:, None] * stride_bh + offs_d[None, :]
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    tl.store(KB + dst, k.to(KB.dtype.element_ty), mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(VB + dst, v.to(VB.dtype.element_ty), mask=mask)


def store_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """k, v: [T, Hkv, D] (strided views of a fused qkv output are fine); buffers [slots, Hkv, D]."""
    T, H, D = k.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_buf.is_contiguous() and v_buf.is_contiguous()
    if T:
        _store_kv_kernel[(T,)](k, v, k_buf, v_buf, loc, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                               k_buf.stride(0), k_buf.stride(1), H, D,
                               BLOCK_H=next_pow2(H), BLOCK_D=next_pow2(D), num_warps=4)
