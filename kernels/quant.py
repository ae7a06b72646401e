"""Dynamic per-token FP8 quantization of activations, for the FP8 GEMM (torch._scaled_mm) of a linear
layer with FP8 weights: x [M, K] -> (e4m3 [M, K], float32 scale [M, 1]), each row's max |x| mapped to
the FP8 range. quantize_per_group does the same for each group of G consecutive values of a row (scales
[M, K / G]): the activations of the block-scaled FP8 GEMM (kernels/fp8_block_gemm.py).

One program per row, in one launch: a pass over the row for its max, a second that scales and stores
(the row is then in cache). Unfused (kernels.reference.quantize_fp8_per_token) this is nine torch ops,
each a launch and most a pass over the activations (abs, amax, casts, clamps, divisions): ~36 launches
per layer of a decode step, which made FP8 slower than bf16 at batch 256.

With silu_mul=True the input is a gated MLP's [M, 2K] gate|up activation and the row quantized is
silu(gate) * up, rounded to x's dtype as activation.silu_and_mul's output would be: the down projection's
input without writing and re-reading that intermediate. The arithmetic is that of
kernels.reference.quantize_fp8_per_token (correctly rounded division, round-to-nearest conversion), so
the bits are the reference's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.activation import silu_mul_f32
from kernels.reference import FP8_DTYPE, FP8_MAX

_EPS = 1e-12  # the reference's floor on a row's max (an all-zero row quantizes to zeros)


@triton.jit
def _row_values(x_row, offs, mask, K, SILU_MUL: tl.constexpr):
    x = tl.load(x_row + offs, mask=mask, other=0.0)
    if SILU_MUL:
        x = silu_mul_f32(x, tl.load(x_row + K + offs, mask=mask, other=0.0)).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def _store_scaled(q_ptrs, x, scale, mask, fp8_max, FP8_OUT: tl.constexpr):
    """x / scale (correctly rounded), saturated to the FP8 range, stored rounded to nearest even in FP8, or with
    FP8_OUT off as it is before that rounding (CPU tests: the interpreter truncates to FP8)."""
    v = tl.math.div_rn(x, scale)
    v = tl.minimum(tl.maximum(v, -fp8_max), fp8_max)
    if FP8_OUT:
        tl.store(q_ptrs, v.to(q_ptrs.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    else:
        tl.store(q_ptrs, v, mask=mask)


@triton.jit
def _per_token_quant_kernel(X, Q, S, K, stride_xm, stride_qm, fp8_max, eps, SILU_MUL: tl.constexpr,
                            FP8_OUT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_xm
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(_row_values(x_row, offs, offs < K, K, SILU_MUL)))
    scale = tl.maximum(tl.max(amax, axis=0), eps) / fp8_max
    tl.store(S + row, scale)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        mask = offs < K
        _store_scaled(Q + row * stride_qm + offs, _row_values(x_row, offs, mask, K, SILU_MUL), scale, mask, fp8_max,
                      FP8_OUT)


def quantize_per_token(x: torch.Tensor, silu_mul: bool = False,
                       out_dtype: torch.dtype = FP8_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (or [M, 2K] gate|up with silu_mul), rows contiguous -> (FP8 [M, K], float32 [M, 1]).
    out_dtype=torch.float32 returns the scaled, clamped values unrounded (what tests check on the CPU)."""
    assert x.dim() == 2 and x.stride(1) == 1 and out_dtype in (FP8_DTYPE, torch.float32)
    M = x.shape[0]
    K = x.shape[1] // 2 if silu_mul else x.shape[1]
    q = torch.empty((M, K), dtype=out_dtype, device=x.device)
    scale = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M:
        BLOCK = min(4096, triton.next_power_of_2(K))
        _per_token_quant_kernel[(M,)](x, q, scale, K, x.stride(0), q.stride(0), FP8_MAX, _EPS,
                                      SILU_MUL=silu_mul, FP8_OUT=out_dtype == FP8_DTYPE, BLOCK=BLOCK,
                                      num_warps=8 if BLOCK >= 2048 else 4)
    return q, scale


@triton.jit
def _per_group_quant_kernel(X, Q, S, K, groups, stride_xm, stride_qm, stride_sm, fp8_max, eps, SILU_MUL: tl.constexpr,
                            FP8_OUT: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr):
    """GROUPS groups of one row a program: each group's max, its scale, the scaled values (as above)."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    gmask = g < groups
    offs = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = gmask[:, None]
    x = _row_values(X + row * stride_xm, offs, mask, K, SILU_MUL)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), eps) / fp8_max
    tl.store(S + row * stride_sm + g, scale, mask=gmask)
    _store_scaled(Q + row * stride_qm + offs, x, scale[:, None], mask, fp8_max, FP8_OUT)


def quantize_per_group(x: torch.Tensor, group: int, silu_mul: bool = False,
                       out_dtype: torch.dtype = FP8_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (or [M, 2K] gate|up with silu_mul), rows contiguous, K a multiple of `group` (a power of two)
    -> (FP8 [M, K], float32 [M, K / group]); out_dtype=torch.float32 as quantize_per_token's."""
    assert x.dim() == 2 and x.stride(1) == 1 and out_dtype in (FP8_DTYPE, torch.float32)
    M = x.shape[0]
    K = x.shape[1] // 2 if silu_mul else x.shape[1]
    assert group >= 1 and group & (group - 1) == 0 and K % group == 0, f"groups of {group} in rows of {K}"
    groups = K // group
    q = torch.empty((M, K), dtype=out_dtype, device=x.device)
    scale = torch.empty((M, groups), dtype=torch.float32, device=x.device)
    if M:
        per = max(1, min(triton.next_power_of_2(groups), 2048 // group))
        _per_group_quant_kernel[(M, triton.cdiv(groups, per))](
            x, q, scale, K, groups, x.stride(0), q.stride(0), scale.stride(0), FP8_MAX, _EPS, SILU_MUL=silu_mul,
            FP8_OUT=out_dtype == FP8_DTYPE, GROUP=group, GROUPS=per, num_warps=4)
    return q, scale
