"""Rotary embedding, neox style (HF Llama's rotate_half), applied in place to q and k.

cos_sin_cache: [max_positions, rotary_dim] fp32, cos in the first half of each row and sin in the
second (kernels.reference.rope_cos_sin_cache builds it). Only the first rotary_dim dims of each head
rotate; the rest pass through.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._utils import next_pow2


@triton.jit
def _rotate_heads(X, stride_h, H, cos, sin, HALF, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    mask = (offs_h[:, None] < H) & (offs_r[None, :] < HALF)
    p1 = X + offs_h[:, None] * stride_h + offs_r[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(X.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, (x2 * cos + x1 * sin).to(X.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(Q, K, POS, CS, stride_qt, stride_qh, stride_kt, stride_kh, stride_cs, HQ, HK, HALF,
                 BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + t).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    cos = tl.load(CS + pos * stride_cs + offs_r, mask=offs_r < HALF, other=0.0)[None, :]
    sin = tl.load(CS + pos * stride_cs + HALF + offs_r, mask=offs_r < HALF, other=0.0)[None, :]
    _rotate_heads(Q + t * stride_qt, stride_qh, HQ, cos, sin, HALF, BLOCK_HQ, BLOCK_R)
    _rotate_heads(K + t * stride_kt, stride_kh, HK, cos, sin, HALF, BLOCK_HK, BLOCK_R)


def _head_strides(x: torch.Tensor, head_dim: int) -> tuple[int, int, int]:
    """(token stride, head stride, num heads) for [T, H*D] or [T, H, D] views with contiguous heads."""
    assert x.stride(-1) == 1
    if x.dim() == 2:
        return x.stride(0), head_dim, x.shape[1] // head_dim
    return x.stride(0), x.stride(1), x.shape[1]


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
               head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on q and k (which may be strided views into a fused qkv output); returns them."""
    sqt, sqh, hq = _head_strides(q, head_dim)
    skt, skh, hk = _head_strides(k, head_dim)
    half = cos_sin_cache.shape[1] // 2
    assert cos_sin_cache.stride(1) == 1 and 2 * half <= head_dim
    T = q.shape[0]
    if T:
        _rope_kernel[(T,)](q, k, positions, cos_sin_cache, sqt, sqh, skt, skh, cos_sin_cache.stride(0),
                           hq, hk, half, BLOCK_HQ=next_pow2(hq), BLOCK_HK=next_pow2(hk),
                           BLOCK_R=next_pow2(half), num_warps=4)
    return q, k
