"""Fused RMSNorm, optionally adding the residual first (one read of x and residual, one write each), or
gathering x from an embedding table first (embed_rms_norm: the lookup and the first norm of a pass in one
launch)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._utils import next_pow2, pdl_launch, pdl_prologue


@triton.jit
def _rms_norm_kernel(X, R, W, Y, Z, IDS, stride_x, stride_r, stride_y, N, eps, NZ,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, ZERO_BLOCK: tl.constexpr = 0,
                     GATHER: tl.constexpr = False):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    if ZERO_BLOCK:  # partial sums the split norms of this pass add into (kernels/residual_norm.py), cleared
        if row == 0:
            for i in range(0, NZ, ZERO_BLOCK):
                zo = i + tl.arange(0, ZERO_BLOCK)
                tl.store(Z + zo, tl.zeros((ZERO_BLOCK,), dtype=Z.dtype.element_ty), mask=zo < NZ)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    if GATHER:  # X is an embedding table: row IDS[row] of it, also written to R (the pass's residual)
        x = tl.load(X + tl.load(IDS + row).to(tl.int64) * stride_x + offs, mask=mask, other=0.0)
        tl.store(R + row * stride_r + offs, x, mask=mask)
    else:
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


def _launch(x, residual, weight, y, zero, ids, stride_x, T, H, eps, has_residual: bool, gather: bool) -> None:
    """T programs of _rms_norm_kernel; `zero` (or None) cleared by the same launch, or alone when T is 0."""
    if not T:
        if zero is not None:
            zero.zero_()
        return
    assert zero is None or zero.is_contiguous()
    BLOCK = next_pow2(H)
    _rms_norm_kernel[(T,)](
        x, residual, weight, y, zero if zero is not None else y, ids, stride_x, residual.stride(0), y.stride(0), H,
        eps, zero.numel() if zero is not None else 0, HAS_RESIDUAL=has_residual, BLOCK=BLOCK,
        ZERO_BLOCK=min(1024, next_pow2(zero.numel())) if zero is not None else 0, GATHER=gather,
        num_warps=min(16, max(1, BLOCK // 512)), **pdl_launch(family="norm"))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             zero: torch.Tensor | None = None):
    """x: [T, H]. Without residual returns y. With residual: residual <- x + residual (in place) and
    returns (y, residual), y = rmsnorm(new residual). `zero`: a contiguous tensor this launch also fills
    with zeros (the first norm of a pass clears the split norms' partial sums: no launch of its own)."""
    assert x.stride(-1) == 1 and x.dim() == 2, "rms_norm wants [T, H] with contiguous rows"
    T, H = x.shape
    y = torch.empty_like(x)
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1
    _launch(x, residual if residual is not None else x, weight, y, zero, x, x.stride(0), T, H, eps,
            has_residual=residual is not None, gather=False)
    return (y, residual) if residual is not None else y


def embed_rms_norm(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float,
                   zero: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(e), e) for e = table[ids] ([T, H]), in one launch; `zero` as rms_norm's."""
    assert ids.dim() == 1 and table.stride(-1) == 1 and table.dim() == 2
    T, H = ids.shape[0], table.shape[1]
    e = torch.empty((T, H), dtype=table.dtype, device=table.device)
    y = torch.empty_like(e)
    _launch(table, e, weight, y, zero, ids, table.stride(0), T, H, eps, has_residual=False, gather=True)
    return y, e
