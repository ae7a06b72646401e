"""SiLU-and-mul for the gated MLP: [T, 2I] (gate | up) -> [T, I]."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def silu_mul_f32(gate, up):
    """silu(gate) * up in fp32 (the arithmetic every kernel applying the gated activation shares)."""
    g = gate.to(tl.float32)
    return g / (1.0 + tl.exp(-g)) * up.to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(X, Y, stride_x, stride_y, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(X + row * stride_x + I + offs, mask=mask, other=0.0)
    tl.store(Y + row * stride_y + offs, silu_mul_f32(gate, up).to(Y.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    assert x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] % 2 == 0
    T, I = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((T, I), dtype=x.dtype, device=x.device)
    BLOCK = 1024
    if T:
        _silu_and_mul_kernel[(T, triton.cdiv(I, BLOCK))](x, out, x.stride(0), out.stride(0), I,
                                                         BLOCK=BLOCK, num_warps=4)
    return out
