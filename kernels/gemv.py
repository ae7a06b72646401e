"""Split-K GEMV for decode-time weight matmuls: y = x @ W^T with x [M <= 4, K], W [N, K].

At batch 1 a linear layer is a pure stream of W through memory, so the kernel is shaped for
bandwidth: each program streams a [BLOCK_N, BLOCK_K] tile per step with 16-byte loads marked
evict-first (W is read once), and K is split across programs when N alone gives too few programs
to keep every SM's memory pipe busy. Split partials go to an fp32 workspace and a second small kernel
sums them, which keeps the result deterministic.

With silu_mul=True the input is a gated MLP's [M, 2K] gate|up activation and the kernel multiplies by
silu(gate) * up, computed as it loads x (rounded to x's dtype, as the silu_and_mul kernel's output
would be): the down projection without a separate activation launch.

`python -m bench.kernels --tune` sweeps the block choices on the current GPU.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels._utils import dot_precision, next_pow2, num_sms, pdl_launch, pdl_prologue
from kernels.activation import silu_mul_f32
from kernels.reference import FP8_DTYPE

MAX_M = 4
# How FP8 rows decode their weights by default (GemvConfig.wdecode); bench/gemv_chain_sweep.py compares them.
FP8_WDECODE = 0


@triton.jit
def _silu_mul(gate, up):
    """Rounded to the input dtype, as activation.silu_and_mul's output is."""
    return silu_mul_f32(gate, up).to(gate.dtype)


@triton.jit
def _load_w(w_ptrs, kbase, K, mask_n, offs_k, EVEN_K: tl.constexpr):
    if EVEN_K:
        w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0, eviction_policy="evict_first")
    else:
        w = tl.load(w_ptrs, mask=mask_n[:, None] & ((kbase + offs_k) < K)[None, :], other=0.0,
                    eviction_policy="evict_first")
    return w


# FP8 e4m3 weights decoded with integer ops instead of the conversion unit (which caps an SM at ~16
# converted values per clock, about the H200's whole weight stream at batch 1): the byte's sign goes to bit
# 31 and its 7 exponent-and-mantissa bits to bits 26..20 of an fp32, which then holds the weight times
# 2^-120 exactly (e4m3's subnormals become fp32 subnormals, which the FMA keeps). x is scaled by 2^64
# before the product and the sum by 2^56 after, so no product is subnormal. (0x7f / 0xff, e4m3's NaN,
# would read as 480: no checkpoint stores NaN weights.)
_X_UP = tl.constexpr(18446744073709551616.0)  # 2^64
_ACC_UP = tl.constexpr(72057594037927936.0)  # 2^56 = 2^120 / 2^64
_SIGN = tl.constexpr(-2147483648)  # 0x80000000 as int32
_MAG = tl.constexpr(0x07F00000)


@triton.jit
def _e4m3_bits(b):
    """int32 holding one e4m3 byte in its low 8 bits -> fp32 = the value x 2^-120."""
    return (((b << 24) & _SIGN) | ((b << 20) & _MAG)).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_words(u):
    """int32 words of four e4m3 bytes -> four fp32 tensors (bytes 0..3 = the lowest first), each x 2^-120."""
    d0 = (((u << 24) & _SIGN) | ((u << 20) & _MAG)).to(tl.float32, bitcast=True)
    d1 = (((u << 16) & _SIGN) | ((u << 12) & _MAG)).to(tl.float32, bitcast=True)
    d2 = (((u << 8) & _SIGN) | ((u << 4) & _MAG)).to(tl.float32, bitcast=True)
    d3 = ((u & _SIGN) | ((u >> 4) & _MAG)).to(tl.float32, bitcast=True)
    return d0, d1, d2, d3


@triton.jit
def _accumulate(acc, w, x_ptrs, kbase, K, mask_m, offs_k, M_PAD: tl.constexpr, EVEN_K: tl.constexpr,
                SILU_MUL: tl.constexpr, DOT_PREC: tl.constexpr, WDECODE: tl.constexpr = 0):
    """acc += x_tile . w_tile: a full-tile fp32 accumulator for one row (reduced once at the end, no
    shuffles in the loop), a 16-row tensor-core tile for several (the MMA is free next to the W stream)."""
    if EVEN_K:
        xm = mask_m[:, None]
    else:
        xm = mask_m[:, None] & ((kbase + offs_k) < K)[None, :]
    x = tl.load(x_ptrs, mask=xm, other=0.0, eviction_policy="evict_last")
    if SILU_MUL:
        x = _silu_mul(x, tl.load(x_ptrs + K, mask=xm, other=0.0, eviction_policy="evict_last"))
    if M_PAD == 1:
        if WDECODE == 1:
            acc += _e4m3_bits(w.to(tl.uint8, bitcast=True).to(tl.int32)) * (x.to(tl.float32) * _X_UP)
        else:
            acc += w.to(tl.float32) * x.to(tl.float32)
    else:
        acc = tl.dot(x.to(w.dtype), tl.trans(w), acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def _gemv_kernel(X, W, Y, P, S, N, K, stride_xm, stride_wn, stride_ym, K_PER_SPLIT,
                 HAS_SCALE: tl.constexpr, M: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr, SILU_MUL: tl.constexpr,
                 PDL: tl.constexpr, WDECODE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.arange(0, M_PAD)
    mask_m = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    k0 = pid_k * K_PER_SPLIT
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + (k0 + offs_k)[None, :]
    x_ptrs = X + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :]
    if M_PAD == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    if PDL:
        # The weights are nobody's output: the first tile streams in while the previous kernel drains.
        w = _load_w(w_ptrs, k0, K, mask_n, offs_k, EVEN_K)
        pdl_prologue(PDL)
        acc = _accumulate(acc, w, x_ptrs, k0, K, mask_m, offs_k, M_PAD, EVEN_K, SILU_MUL, DOT_PREC, WDECODE)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    for kk in range(BLOCK_K if PDL else 0, K_PER_SPLIT, BLOCK_K):
        w = _load_w(w_ptrs, k0 + kk, K, mask_n, offs_k, EVEN_K)
        acc = _accumulate(acc, w, x_ptrs, k0 + kk, K, mask_m, offs_k, M_PAD, EVEN_K, SILU_MUL, DOT_PREC, WDECODE)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if M_PAD == 1:
        acc = tl.sum(acc, axis=1)[None, :]
    if WDECODE == 1:
        acc = acc * _ACC_UP
    if HAS_SCALE:  # FP8 weights: one dequantization scale per output row (linear, so per split too)
        acc = acc * tl.load(S + offs_n, mask=mask_n, other=0.0)[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=mask)
    else:
        tl.store(P + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)


@triton.jit
def _acc_words(acc, u, x_ptrs, kbase, K, offs_q, EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr):
    """acc [BLOCK_N, BLOCK_K/4] += the four products of each weight word with its four inputs."""
    d0, d1, d2, d3 = _e4m3_words(u)
    xs = []
    for i in tl.static_range(4):
        if EVEN_K:
            xi = tl.load(x_ptrs + i, eviction_policy="evict_last")
            if SILU_MUL:
                xi = _silu_mul(xi, tl.load(x_ptrs + K + i, eviction_policy="evict_last"))
        else:
            xm = (kbase + 4 * offs_q + i) < K
            xi = tl.load(x_ptrs + i, mask=xm, other=0.0, eviction_policy="evict_last")
            if SILU_MUL:
                xi = _silu_mul(xi, tl.load(x_ptrs + K + i, mask=xm, other=0.0, eviction_policy="evict_last"))
        xs.append(xi.to(tl.float32) * _X_UP)
    return acc + (d0 * xs[0][None, :] + d1 * xs[1][None, :]) + (d2 * xs[2][None, :] + d3 * xs[3][None, :])


@triton.jit
def _gemv_e4m3_words_kernel(X, W, Y, P, S, N, K, stride_wn, K_PER_SPLIT, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
                            SILU_MUL: tl.constexpr, PDL: tl.constexpr):
    """One row of x against FP8 e4m3 weights read as int32 words of four (W: [N, K/4] int32, stride_wn in
    words): the decoding is a few shifts and masks per word, no conversion unit."""
    BK4: tl.constexpr = BLOCK_K // 4
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_q = tl.arange(0, BK4)
    k0 = pid_k * K_PER_SPLIT
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + (k0 // 4 + offs_q)[None, :]
    x_ptrs = X + k0 + 4 * offs_q
    acc = tl.zeros((BLOCK_N, BK4), dtype=tl.float32)
    K4 = K // 4
    start = 0
    if PDL:
        wm = mask_n[:, None] if EVEN_K else mask_n[:, None] & ((k0 // 4 + offs_q) < K4)[None, :]
        u = tl.load(w_ptrs, mask=wm, other=0, eviction_policy="evict_first")
        pdl_prologue(PDL)
        acc = _acc_words(acc, u, x_ptrs, k0, K, offs_q, EVEN_K, SILU_MUL)
        w_ptrs += BK4
        x_ptrs += BLOCK_K
        start = BLOCK_K
    for kk in range(start, K_PER_SPLIT, BLOCK_K):
        wm = mask_n[:, None] if EVEN_K else mask_n[:, None] & (((k0 + kk) // 4 + offs_q) < K4)[None, :]
        u = tl.load(w_ptrs, mask=wm, other=0, eviction_policy="evict_first")
        acc = _acc_words(acc, u, x_ptrs, k0 + kk, K, offs_q, EVEN_K, SILU_MUL)
        w_ptrs += BK4
        x_ptrs += BLOCK_K
    out = tl.sum(acc, axis=1) * _ACC_UP * tl.load(S + offs_n, mask=mask_n, other=0.0)
    if SPLIT_K == 1:
        tl.store(Y + offs_n, out.to(Y.dtype.element_ty), mask=mask_n)
    else:
        tl.store(P + pid_k * N + offs_n, out, mask=mask_n)


@triton.jit
def _splitk_reduce_kernel(P, Y, N, stride_ym, M: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                          PDL: tl.constexpr):
    pdl_prologue(PDL)
    m = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(P + (s * M + m) * N + offs, mask=mask, other=0.0)
    tl.store(Y + m * stride_ym + offs, acc.to(Y.dtype.element_ty), mask=mask)


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    wdecode: int = 0  # FP8 rows: 0 the conversion unit, 1 bits per byte, 2 int32 words of four bytes


def default_config(M: int, N: int, K: int, weight_bytes: int = 2) -> GemvConfig:
    """From sweeps on H200 (bench/kernels.py --tune, cold L2). No split-K for the Llama-8B shapes:
    N >= 4096 already gives enough programs. One row: narrow, long tiles for short N (more programs,
    more bytes in flight each), wider and shorter ones for long N. Several rows run on tensor cores,
    which want >= 16 output columns per program."""
    if M == 1 and weight_bytes == 1:  # FP8 rows (bench/fp8_gemv_sweep.py, H200, 2026-11-30)
        block_n, block_k, warps = (8, 1024, 4) if N <= 4096 else (8, 512, 4) if N <= 8192 else (8, 256, 2)
    elif M == 1 and N <= 4096 and K <= 4096:
        # o_proj's shape: four rows by half of K per program, twice the programs; with PDL, half of the
        # weights stream in while the previous kernels drain (bench/gemv_chain_sweep.py, H200, 2026-12-01:
        # -8.7 us per layer in the chain).
        block_n, block_k, warps = 4, 2048, 2
    elif M == 1:
        block_n, block_k, warps = (8, 1024, 2) if N <= 4096 else (8, 512, 4) if N <= 8192 else (16, 256, 4)
    else:
        block_n, block_k, warps = (32, 512, 4) if N <= 4096 else (64, 512, 4) if N <= 8192 else (64, 256, 4)
    block_k = min(block_k, max(16, next_pow2(K)))
    split_k = 1
    k_steps = triton.cdiv(K, block_k)
    # Split K only when N is too short to put two programs on every SM.
    while triton.cdiv(N, block_n) * split_k < 2 * num_sms() and split_k * 2 <= k_steps and split_k < 16:
        split_k *= 2
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=warps,
                      wdecode=FP8_WDECODE if weight_bytes == 1 else 0)


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
         config: GemvConfig | None = None, scale: torch.Tensor | None = None,
         tensor_cores: bool = False, silu_mul: bool = False, pdl: bool | None = None) -> torch.Tensor:
    """y = x @ w^T for x [M, K] (M <= 4), w [N, K] with contiguous rows; y in x's dtype.
    `scale` (float32 [N]) dequantizes FP8 weights row by row (one row of x only: x is not quantized).
    silu_mul: x is [M, 2K] (gate | up) and y = silu_and_mul(x) @ w^T.
    pdl: programmatic dependent launch (None: the process default; see kernels._utils.pdl_launch)."""
    M, K = x.shape
    if silu_mul:
        assert K % 2 == 0
        K //= 2
    N = w.shape[0]
    assert M <= MAX_M, "gemv is for decode batches of at most 4 rows; use a GEMM"
    assert w.shape[1] == K and w.stride(1) == 1 and x.stride(1) == 1
    assert scale is None or (scale.shape == (N,) and scale.dtype == torch.float32)
    assert scale is None or M == 1 or x.dtype == w.dtype, "FP8 weights take one unquantized row of x"
    cfg = config or default_config(M, N, K, w.element_size())
    dot = M > 1 or tensor_cores
    if dot and cfg.block_n < 16:  # tensor-core tile minimum
        cfg = dataclasses.replace(cfg, block_n=16)
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    k_per_split = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    split_k = triton.cdiv(K, k_per_split)
    even_k = K % cfg.block_k == 0 and K % k_per_split == 0
    partial = (torch.empty((split_k, M, N), dtype=torch.float32, device=x.device) if split_k > 1 else out)
    wdecode = cfg.wdecode if (scale is not None and not dot and w.dtype == FP8_DTYPE) else 0
    if wdecode == 2 and (K % 4 or w.stride(0) % 4 or w.data_ptr() % 4 or cfg.block_k % 4):
        wdecode = 1
    if wdecode == 2:
        _gemv_e4m3_words_kernel[(triton.cdiv(N, cfg.block_n), split_k)](
            x, w.view(torch.int32), out, partial, scale, N, K, w.stride(0) // 4, k_per_split,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split_k, EVEN_K=even_k, SILU_MUL=silu_mul,
            num_warps=cfg.num_warps, **pdl_launch(pdl))
    else:
        _gemv_kernel[(triton.cdiv(N, cfg.block_n), split_k)](
            x, w, out, partial, scale if scale is not None else w, N, K, x.stride(0), w.stride(0), out.stride(0),
            k_per_split, HAS_SCALE=scale is not None, M=M, M_PAD=16 if dot else 1, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, SPLIT_K=split_k, EVEN_K=even_k, DOT_PREC=dot_precision(x.dtype), SILU_MUL=silu_mul,
            WDECODE=wdecode, num_warps=cfg.num_warps, **pdl_launch(pdl))
    if split_k > 1:
        BLOCK = 1024
        _splitk_reduce_kernel[(triton.cdiv(N, BLOCK), M)](partial, out, N, out.stride(0), M=M,
                                                          SPLIT_K=split_k, BLOCK=BLOCK, num_warps=4,
                                                          **pdl_launch(pdl))
    return out
