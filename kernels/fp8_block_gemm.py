"""GEMM for block-scaled FP8 weights (DeepSeek-V3 / Qwen3-FP8 checkpoints: `weight_block_size` [bn, bk]):
y = x @ W^T with W [N, K] in e4m3 and one float32 scale per [bn, bk] block, x quantized per token and group
of bk inputs (kernels.quant.quantize_per_group).

Each K step of BLOCK_K = bk inputs is one FP8 tensor-core product per tile, whose fp32 result is scaled by
the rows' activation scales and the columns' weight-block scales before it is added into the accumulator: the
scales of a step are the same for all its products, which is what makes the blocks exact.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _block_fp8_gemm_kernel(A, AS, B, BS, C, BIAS, M, N, K, stride_am, stride_asm, stride_bn, stride_bsn, stride_cm,
                           SCALE_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr):
    # Programs ordered in groups of GROUP_M row tiles, so that a wave shares its weight tiles in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows
    pid_n = (pid % per_group) // rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = A + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = B + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    as_ptrs = AS + offs_m * stride_asm
    bs_ptrs = BS + (offs_n // SCALE_N) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K // BLOCK_K):  # K is a multiple of BLOCK_K (the host checks)
        a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kb, mask=mask_m, other=0.0)
        b_s = tl.load(bs_ptrs + kb, mask=mask_n, other=0.0)
        if BLOCK_K < 32:  # FP8 tensor-core products take K >= 32: narrower blocks multiply in f16 (exact)
            a = a.to(tl.float16)
            b = b.to(tl.float16)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(C + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :], acc.to(C.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def default_tiles(M: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) for M rows. Not yet swept on a GPU: the usual Hopper shapes, rows
    padded to what the token count fills."""
    if M <= 16:
        return 16, 64, 4, 4
    if M <= 32:
        return 32, 64, 4, 4
    if M <= 64:
        return 64, 128, 4, 3
    return 128, 128, 8, 3


def block_fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """xq FP8 [M, K] with x_scale float32 [M, K / bk] (quantize_per_group(x, bk)) against weight FP8 [N, K] with
    weight_scale float32 [N / bn, K / bk] -> [M, N] in out_dtype (+ bias)."""
    M, K = xq.shape
    N = weight.shape[0]
    sn, sk = weight_scale.shape
    assert weight.shape[1] == K and N % sn == 0 and K % sk == 0, "block scales tile the weight"
    bn, bk = N // sn, K // sk
    assert x_scale.shape == (M, sk), f"activation scales {tuple(x_scale.shape)}, expected ({M}, {sk})"
    assert bk >= 16 and bk & (bk - 1) == 0, f"block K {bk}: a power of two of at least 16"
    assert xq.stride(1) == 1 and weight.stride(1) == 1 and weight_scale.stride(1) == 1
    out = torch.empty((M, N), dtype=out_dtype, device=xq.device)
    if M == 0:
        return out
    block_m, block_n, warps, stages = default_tiles(M)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _block_fp8_gemm_kernel[grid](
        xq, x_scale, weight, weight_scale, out, bias if bias is not None else out, M, N, K, xq.stride(0),
        x_scale.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0), SCALE_N=bn, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=bk, GROUP_M=8, HAS_BIAS=bias is not None, num_warps=warps, num_stages=stages)
    return out
