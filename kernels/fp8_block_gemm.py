"""GEMM for block-scaled FP8 weights (DeepSeek-V3 / Qwen3-FP8 checkpoints: `weight_block_size` [bn, bk]):
y = x @ W^T with W [N, K] in e4m3 and one float32 scale per [bn, bk] block, x quantized per token and group
of bk inputs (kernels.quant.quantize_per_group).

Each K step of BLOCK_K = bk inputs is one FP8 tensor-core product per tile, whose fp32 result is scaled by
the rows' activation scales and the columns' weight-block scales before it is added into the accumulator: the
scales of a step are the same for all its products, which is what makes the blocks exact. Small batches
(decode) split K when the output tiles alone cannot give every SM work, partial sums added by a second kernel
in a fixed order (deterministic, as the GEMV's split K).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._utils import num_sms
from shared.knobs import knob


@triton.jit
def _block_fp8_gemm_kernel(A, AS, B, BS, C, BIAS, M, N, K_STEPS, stride_am, stride_asm, stride_bn, stride_bsn,
                           stride_cm, SCALE_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr,
                           SPLIT_K: tl.constexpr):
    """K_STEPS blocks of K a program; with SPLIT_K > 1 program_id(1) picks its share of K and C is an fp32
    [SPLIT_K, M, N] workspace of partial sums (_split_sum_kernel adds them in a fixed order)."""
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
    first = tl.program_id(1) * K_STEPS  # this split's first block of K
    a_ptrs = A + offs_m[:, None].to(tl.int64) * stride_am + first * BLOCK_K + offs_k[None, :]
    b_ptrs = B + offs_n[None, :].to(tl.int64) * stride_bn + first * BLOCK_K + offs_k[:, None]
    as_ptrs = AS + offs_m * stride_asm + first
    bs_ptrs = BS + (offs_n // SCALE_N) * stride_bsn + first
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K_STEPS):  # K is a multiple of BLOCK_K (the host checks)
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
    if HAS_BIAS and SPLIT_K == 1:
        acc += tl.load(BIAS + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if SPLIT_K > 1:
        C += tl.program_id(1).to(tl.int64) * M * N
    tl.store(C + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :], acc.to(C.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _split_sum_kernel(P, C, BIAS, MN, N, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """C (contiguous [M, N]) = the SPLIT_K partial sums of P [SPLIT_K, M, N], added in split order (+ bias)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(P + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(BIAS + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(C + offs, acc.to(C.dtype.element_ty), mask=mask)


def default_tiles(M: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) for M rows: the usual Hopper shapes, rows padded to what the token count
    fills. Past 64 rows 64 x 128 at 4 warps, 4 stages (the sweep's best against 128 x 128 at 8 warps). Below, the
    best tiles differed by shape and are not taken without a choice by shape (docs/kernels.md)."""
    if M <= 16:
        return 16, 64, 4, 4
    if M <= 32:
        return 32, 64, 4, 4
    if M <= 64:
        return 64, 128, 4, 3
    return 64, 128, 4, 4


# K is split while the grid has fewer programs than this many an SM (split_k; 0 turns splitting off). Not yet measured.
MIN_PROGRAMS_PER_SM = knob("MIN_PROGRAMS_PER_SM")


def split_k(tiles: int, k_steps: int, sms: int) -> int:
    """Splits of K (a power of two) for a grid of `tiles` output tiles: doubled while the grid gives fewer than
    MIN_PROGRAMS_PER_SM programs an SM and each split keeps at least four blocks of K (small batches against
    o_proj or down_proj's 4,096 output columns would otherwise leave SMs without work; the weight stream wants
    them all)."""
    split = 1
    while tiles * split < MIN_PROGRAMS_PER_SM * sms and k_steps // (split * 2) >= 4 and split < 16:
        split *= 2
    return split


def block_fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None, out_dtype: torch.dtype, splits: int | None = None) -> torch.Tensor:
    """xq FP8 [M, K] with x_scale float32 [M, K / bk] (quantize_per_group(x, bk)) against weight FP8 [N, K] with
    weight_scale float32 [N / bn, K / bk] -> [M, N] in out_dtype (+ bias). splits: of K (None: split_k's choice;
    K / bk must divide by it)."""
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
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    if splits is None:
        splits = split_k(tiles, sk, num_sms())
    assert sk % splits == 0, f"{sk} blocks of K in {splits} splits"
    dst = out if splits == 1 else torch.empty((splits, M, N), dtype=torch.float32, device=xq.device)
    _block_fp8_gemm_kernel[(tiles, splits)](
        xq, x_scale, weight, weight_scale, dst, bias if bias is not None else out, M, N, sk // splits, xq.stride(0),
        x_scale.stride(0), weight.stride(0), weight_scale.stride(0), N if splits > 1 else out.stride(0),
        SCALE_N=bn, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, GROUP_M=8, HAS_BIAS=bias is not None,
        SPLIT_K=splits, num_warps=warps, num_stages=stages)
    if splits > 1:
        BLOCK = 1024
        _split_sum_kernel[(triton.cdiv(M * N, BLOCK),)](dst, out, bias if bias is not None else out, M * N, N,
                                                        SPLIT_K=splits, HAS_BIAS=bias is not None, BLOCK=BLOCK,
                                                        num_warps=4)
    return out
