"""Fused RMSNorm, optionally adding the residual first (one read of x and residual, one write each)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._utils import next_pow2, pdl_launch, pdl_prologue


@triton.jit
def _rms_norm_kernel(X, R, W, Y, stride_x, stride_r, stride_y, N, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to the activation dtype before normalising, as the unfused model does.
        x = (x.to(tl.float32) + tl.load(R + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32))
        x = x.to(R.dtype.element_ty)
        tl.store(R + row * stride_r + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + offs, (xf * rstd * w).to(Y.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x: [T, H]. Without residual returns y. With residual: residual <- x + residual (in place) and
    returns (y, residual), y = rmsnorm(new residual)."""
    assert x.stride(-1) == 1 and x.dim() == 2, "rms_norm wants [T, H] with contiguous rows"
    T, H = x.shape
    y = torch.empty_like(x)
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1
    BLOCK = next_pow2(H)
    num_warps = min(16, max(1, BLOCK // 512))
    if T:
        _rms_norm_kernel[(T,)](
            x, residual if residual is not None else x, weight, y,
            x.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0), H, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=BLOCK, num_warps=num_warps,
            **pdl_launch(family="norm"))
    return (y, residual) if residual is not None else y
