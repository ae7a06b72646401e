"""Scatter the new tokens' K and V into their pool slots, in the pool's dtype.

A 16- or 32-bit pool takes a plain cast. An FP8 pool (--kv-cache-dtype fp8_e4m3 / fp8_e5m2) stores
x / scale (one scale per layer for K and one for V, 1.0 unless the checkpoint calibrated them), saturated to
the format's largest finite value and rounded to nearest even; attention multiplies the scale back in.
`to_pool` is that conversion, shared by every kernel that writes the pool.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._utils import next_pow2
from kernels.reference import inverse_scale


@triton.jit
def to_pool(x, inv_scale, DT: tl.constexpr):
    """x as pool dtype DT. FP8: x * inv_scale in fp32, clamped to DT's finite range and rounded to nearest even
    here (the mantissa's dropped bits by integer arithmetic, subnormals by an add that leaves their spacing as
    fp32's), so the final cast is exact: the hardware's round-to-nearest cast gives the same bits, and Triton's
    CPU interpreter, which truncates FP8 casts, does too. inv_scale is unused for other dtypes."""
    if DT.is_fp8():
        if DT == tl.float8e5:
            FMAX: tl.constexpr = 57344.0
            DROP: tl.constexpr = 21  # 23 - 2 mantissa bits
            MIN_NORMAL: tl.constexpr = 6.103515625e-05  # 2^-14
            SUB_ADD: tl.constexpr = 128.0  # 2^7: fp32's spacing there is 2^-16, e5m2's subnormal step
        else:  # e4m3fn
            FMAX: tl.constexpr = 448.0
            DROP: tl.constexpr = 20  # 23 - 3 mantissa bits
            MIN_NORMAL: tl.constexpr = 0.015625  # 2^-6
            SUB_ADD: tl.constexpr = 16384.0  # 2^14: fp32's spacing there is 2^-9, e4m3's subnormal step
        y = x.to(tl.float32) * inv_scale
        y = tl.minimum(tl.maximum(y, -FMAX), FMAX)
        bits = y.to(tl.int32, bitcast=True)
        bits = (bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)) & ~((1 << DROP) - 1)
        normal = bits.to(tl.float32, bitcast=True)
        a = tl.abs(y)
        sub = (a + SUB_ADD) - SUB_ADD
        sub = tl.where(y < 0, -sub, sub)
        return tl.where(a < MIN_NORMAL, sub, normal).to(DT)
    else:
        return x.to(DT)


@triton.jit
def _store_kv_kernel(K, V, KB, VB, LOC, inv_k_scale, inv_v_scale, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_bs, stride_bh, H, D, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(LOC + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    dst = slot * stride_bs + offs_h[:, None] * stride_bh + offs_d[None, :]
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    tl.store(KB + dst, to_pool(k, inv_k_scale, KB.dtype.element_ty), mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(VB + dst, to_pool(v, inv_v_scale, VB.dtype.element_ty), mask=mask)


def store_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k, v: [T, Hkv, D] (strided views of a fused qkv output are fine); buffers [slots, Hkv, D]. The scales
    divide what an FP8 pool stores (kernels.reference.to_pool_ref)."""
    T, H, D = k.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_buf.is_contiguous() and v_buf.is_contiguous()
    if T:
        _store_kv_kernel[(T,)](k, v, k_buf, v_buf, loc, inverse_scale(k_scale), inverse_scale(v_scale),
                               k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                               k_buf.stride(0), k_buf.stride(1), H, D,
                               BLOCK_H=next_pow2(H), BLOCK_D=next_pow2(D), num_warps=4)
