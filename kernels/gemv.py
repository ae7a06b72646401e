"""Split-K GEMV for decode-time weight matmuls: y = x @ W^T with x [M <= 64, K], W [N, K].

At batch 1 a linear layer is a pure stream of W through memory, so the kernel is shaped for
bandwidth: each program streams a [BLOCK_N, BLOCK_K] tile per step with 16-byte loads marked
evict-first (W is read once), and K is split across programs when N alone gives too few programs
to keep every SM's memory pipe busy. Split partials go to an fp32 workspace and a second small kernel
sums them, which keeps the result deterministic.

Several rows (2..64) run on tensor cores, x padded to one tile of 16, 32 or 64 rows; FP8 weights with per-row
scales are then widened to x's dtype tile by tile (weight-only: the weights stream at one byte each, x is not
quantized).

With silu_mul=True the input is a gated MLP's [M, 2K] gate|up activation and the kernel multiplies by
silu(gate) * up, computed as it loads x (rounded to x's dtype, as the silu_and_mul kernel's output
would be): the down projection without a separate activation launch.

With gated_out=True w is a gated MLP's gate|up projection [2I, K] and the kernel returns
silu(gate) * up [M, I]: each program takes BLOCK_N / 2 gate rows and the matching up rows, and its epilogue
rounds both as the projection's output would be, then gates them (the bits of silu_and_mul of that output). The
down projection then reads I values, not 2I with the activation computed in its load.

With norm_in / add_norm (one row, or two on the one-row kernel) the GEMV is the consumer or the producer of a
residual RMSNorm split around it (kernels/residual_norm.py): the consumer scales its sums by the norm, the producer's
epilogue adds into the residual and writes the norm's input in place of y (in the reduce kernel where K is split).
With rope (kernels/rope_store.py) the qkv projection's epilogue rotates q and k and stores k and v in
the KV pool: each program then owns whole rotary pairs of rows.

`python -m bench.kernels --tune` sweeps the block choices on the current GPU.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels._utils import dot_precision, next_pow2, num_sms, pdl_launch, pdl_prologue, pdl_trigger_early, tile_table
from kernels.activation import silu_mul_f32
from kernels.reference import scale_block
from kernels.residual_norm import NORM_SLOTS, ResidualNorm
from kernels.rope_store import RopeStore, rope_args, rope_rows, rope_store_epilogue, rope_store_inputs, rope_store_rows
from shared.knobs import knob

# Rows of x a launch takes: one on the row kernels, up to 64 on tensor cores (one tile of M_PAD = 16, 32 or 64 rows).
MAX_M = 64


@triton.jit
def _silu_mul(gate, up):
    """Rounded to the input dtype, as activation.silu_and_mul's output is."""
    return silu_mul_f32(gate, up).to(gate.dtype)


@triton.jit
def _out(acc, X, Y):
    """fp32 sums as stored: rounded to the activation dtype, as a GEMM of that dtype would return them, then held
    in Y's (the same where they match; an fp32 Y gets the rounded logits widened, as the unfused lm_head's)."""
    return acc.to(X.dtype.element_ty).to(Y.dtype.element_ty)


@triton.jit
def _gated_rows(pid_n, N, BLOCK_N: tl.constexpr):
    """A gated program's rows (gated_out): BLOCK_N / 2 gate rows, then the up rows I = N / 2 further on."""
    H: tl.constexpr = BLOCK_N // 2
    j = tl.arange(0, BLOCK_N)
    i = pid_n * H + j % H
    return i + (j // H) * (N // 2), i < N // 2


@triton.jit
def _gated_epilogue(out, pid_n, N, X, Y, BLOCK_N: tl.constexpr):
    """out: a gated program's fp32 sums in _gated_rows' order. Rounded as the projection's output would be
    stored, split into gate and up, gated: silu(gate) * up (rounded as silu_and_mul's) at the program's I rows."""
    H: tl.constexpr = BLOCK_N // 2
    v = out.to(X.dtype.element_ty)
    gate, up = tl.split(tl.trans(tl.reshape(v, (2, H))))
    offs = pid_n * H + tl.arange(0, H)
    tl.store(Y + offs, _silu_mul(gate, up).to(Y.dtype.element_ty), mask=offs < N // 2)


@triton.jit
def _gated_rows_epilogue(acc, offs_m, mask_m, pid_n, N, X, Y, stride_ym, BLOCK_N: tl.constexpr):
    """_gated_epilogue for several rows: acc [M_PAD, BLOCK_N], each row's sums in _gated_rows' order."""
    H: tl.constexpr = BLOCK_N // 2
    v = tl.reshape(acc.to(X.dtype.element_ty), (acc.shape[0], 2, H))
    gate, up = tl.split(tl.permute(v, (0, 2, 1)))
    offs = pid_n * H + tl.arange(0, H)
    tl.store(Y + offs_m[:, None] * stride_ym + offs[None, :], _silu_mul(gate, up).to(Y.dtype.element_ty),
             mask=mask_m[:, None] & (offs < N // 2)[None, :])


@triton.jit
def _load_w(w_ptrs, kbase, K, mask_n, offs_k, EVEN_K: tl.constexpr, EVICT: tl.constexpr):
    if EVEN_K:
        w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0, eviction_policy=EVICT)
    else:
        w = tl.load(w_ptrs, mask=mask_n[:, None] & ((kbase + offs_k) < K)[None, :], other=0.0,
                    eviction_policy=EVICT)
    return w


@triton.jit
def _norm_in_scale(SQ, K, eps, NSLOT: tl.constexpr):
    """Consumer of a split residual RMSNorm (kernels/residual_norm.py): rsqrt(mean(r^2) + eps) from the
    producer's NSLOT fp64 partial sums (read after the PDL wait, like any earlier kernel's output)."""
    total = tl.sum(tl.load(SQ + tl.arange(0, NSLOT)), axis=0)
    return 1.0 / tl.sqrt(total.to(tl.float32) / K + eps)


@triton.jit
def _add_norm_inputs(R, GAMMA, offs_n, mask_n):
    """The producer's residual rows and gammas, loaded once the previous kernel is waited for and well before
    the epilogue needs them (no dependent round trip to memory in a program's tail)."""
    return (tl.load(R + offs_n, mask=mask_n, other=0.0),
            tl.load(GAMMA + offs_n, mask=mask_n, other=0.0).to(tl.float32))


@triton.jit
def _add_norm_epilogue(h, r, gamma, offs_n, mask_n, pid, R, G, SQ, NSLOT: tl.constexpr):
    """Producer of a split residual RMSNorm: this program's outputs h (fp32 [BLOCK], rounded to the
    activation dtype as the unfused layer's output is) added into the residual rows r it owns, in place;
    gamma * residual written for the consumer GEMV; the rows' sum of squares added into one of NSLOT
    partials (programs spread over them: no queue on one address)."""
    r_new = (h.to(r.dtype).to(tl.float32) + r.to(tl.float32)).to(r.dtype)
    tl.store(R + offs_n, r_new, mask=mask_n)
    rf = r_new.to(tl.float32)
    tl.store(G + offs_n, (rf * gamma).to(G.dtype.element_ty), mask=mask_n)
    tl.atomic_add(SQ + pid % NSLOT, tl.sum(rf * rf, axis=0).to(tl.float64), sem="relaxed")


@triton.jit
def _epilogue_inputs(pid_n, offs_n, mask_n, N, K, R, GAMMA, SQ, eps, POS, CS, stride_cs, LOC, QS, KVS,
                     NORM_IN: tl.constexpr, ADD_NORM: tl.constexpr, ROPE: tl.constexpr, NSLOT: tl.constexpr,
                     BLOCK_N: tl.constexpr, HALF: tl.constexpr):
    """The epilogues' inputs that earlier kernels wrote (after the wait), loaded ahead of the K loop so that no
    dependent round trip to memory sits in a program's tail: a split norm's scale (consumer) or residual rows
    and gammas (producer), rope's cos, sin and slot. Placeholders for the epilogues a kernel does not run."""
    rs, r_in, gamma, cos, sin, slot = 1.0, 0.0, 0.0, 1.0, 0.0, 0
    if NORM_IN:
        rs = _norm_in_scale(SQ, K, eps, NSLOT)
    if ADD_NORM:
        r_in, gamma = _add_norm_inputs(R, GAMMA, offs_n, mask_n)
    if ROPE:
        cos, sin, slot = rope_store_inputs(pid_n, N, POS, CS, stride_cs, LOC, QS, KVS, BLOCK_N, HALF)
    return rs, r_in, gamma, cos, sin, slot


@triton.jit
def _pair_sum(p):
    """[R, C] -> [R, C / 2]: neighbouring columns added."""
    a, b = tl.split(tl.reshape(p, (p.shape[0], p.shape[1] // 2, 2)))
    return a + b


@triton.jit
def _block_scales(S, stride_s, offs_n, mask_n, kbase, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SBN: tl.constexpr, SBK: tl.constexpr, EVEN_K: tl.constexpr):
    """Block-scaled FP8 weights (scales [N / SBN, K / SBK]): the scale of each eight-input lane of a tile's
    [BLOCK_N, BLOCK_K / 8] sums (a lane lies in one block: SBK is a multiple of 8). Where SBN is a multiple of
    BLOCK_N the tile lies in one block row: one row of scales, broadcast over the tile's rows."""
    lane_k = kbase + tl.arange(0, BLOCK_K // 8) * 8
    if SBN % BLOCK_N == 0:
        ptrs = S + ((tl.program_id(0) * BLOCK_N) // SBN) * stride_s + lane_k // SBK
        if EVEN_K:
            scales = tl.load(ptrs)[None, :]
        else:
            scales = tl.load(ptrs, mask=lane_k < K, other=0.0)[None, :]
    else:
        ptrs = S + (offs_n // SBN)[:, None] * stride_s + (lane_k // SBK)[None, :]
        if EVEN_K:
            scales = tl.load(ptrs, mask=mask_n[:, None], other=0.0)
        else:
            scales = tl.load(ptrs, mask=mask_n[:, None] & (lane_k < K)[None, :], other=0.0)
    return scales


@triton.jit
def _load_x(x_ptrs, kbase, K, mask_m, offs_k, EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr):
    """x's [M_PAD, BLOCK_K] tile at kbase (rows past M and columns past K zero), the gated activation where SILU_MUL
    (x_ptrs then points into the gate half, the up half K on)."""
    if EVEN_K:
        xm = mask_m[:, None]
    else:
        xm = mask_m[:, None] & ((kbase + offs_k) < K)[None, :]
    x = tl.load(x_ptrs, mask=xm, other=0.0, eviction_policy="evict_last")
    if SILU_MUL:
        x = _silu_mul(x, tl.load(x_ptrs + K, mask=xm, other=0.0, eviction_policy="evict_last"))
    return x


@triton.jit
def _accumulate(acc, w, x_ptrs, kbase, K, mask_m, offs_k, M_PAD: tl.constexpr, EVEN_K: tl.constexpr,
                SILU_MUL: tl.constexpr, DOT_PREC: tl.constexpr, F16: tl.constexpr = False, S=None, stride_s=0,
                offs_n=None, mask_n=None, BLOCK_N: tl.constexpr = 1, SBN: tl.constexpr = 0, SBK: tl.constexpr = 0):
    """acc += x_tile . w_tile: a full-tile fp32 accumulator for one row (reduced once at the end, no
    shuffles in the loop), a 16-row tensor-core tile for several (the MMA is free next to the W stream).
    SBK > 0 (F16 only): block-scaled weights, each lane's sum multiplied by its block's scale (_block_scales)."""
    x = _load_x(x_ptrs, kbase, K, mask_m, offs_k, EVEN_K, SILU_MUL)
    if F16:
        # FP8 rows: weights converted to f16 only (e4m3 is exact in f16), products with x * 2^-8 (so that
        # |w| <= 448 times x stays in f16's range) summed eight at a time in f16, then in fp32. About half
        # the conversion and FMA instructions of the fp32 path, which is what bounds this GEMV. Range: a
        # product overflows f16 only past |x| ~ 37,000 (and eight of them summed past ~4,700 each, all at
        # the largest weights and of one sign); x below ~0.016 is an f16 subnormal after the scaling, whose
        # precision loss only touches terms far below the sum's largest.
        p = w.to(tl.float16) * (x.to(tl.float32) * 0.00390625).to(tl.float16)
        lanes = _pair_sum(_pair_sum(_pair_sum(p))).to(tl.float32)
        if SBK:
            acc += lanes * _block_scales(S, stride_s, offs_n, mask_n, kbase, K, BLOCK_N, offs_k.shape[0], SBN, SBK,
                                         EVEN_K)
        else:
            acc += lanes
    elif M_PAD == 1:
        acc += w.to(tl.float32) * x.to(tl.float32)
    elif w.dtype.is_fp8():  # FP8 weights, several rows: weight-only, each tile widened to x's dtype for the MMA (e4m3
        # is exact in bf16 and f16); the per-row scale multiplies the sums after the K loop
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=DOT_PREC)
    else:
        acc = tl.dot(x.to(w.dtype), tl.trans(w), acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def _sum_splits(P, m, N, offs, mask, M: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                CACHE: tl.constexpr):
    """Row m's split-K partials (P: [SPLIT_K, M, N] fp32) at offs, summed in split order. CACHE ".cg" where other
    programs of the running grid wrote them (the ticketed GEMV's last split): read from L2, not a stale L1."""
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(P + (s * M + m) * N + offs, mask=mask, other=0.0, cache_modifier=CACHE)
    return acc


@triton.jit
def _gemv_kernel(X, W, Y, P, S, N, K, stride_xm, stride_wn, stride_ym, K_PER_SPLIT, R, GAMMA, SQ, eps,
                 POS, CS, stride_cs, LOC, KB, VB, stride_bs, QS, KVS,
                 HAS_SCALE: tl.constexpr, M: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr, SILU_MUL: tl.constexpr,
                 PDL: tl.constexpr, PRE: tl.constexpr, F16: tl.constexpr = False, NORM_IN: tl.constexpr = False,
                 ADD_NORM: tl.constexpr = False, NSLOT: tl.constexpr = 16, ROPE: tl.constexpr = False,
                 HALF: tl.constexpr = 1, stride_s=0, SBN: tl.constexpr = 0,
                 SBK: tl.constexpr = 0, TK=None, TICKETED: tl.constexpr = False, GATED: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if ROPE:  # whole rotary pairs a program (one row, no split: the host checks)
        offs_n, mask_n = rope_rows(pid_n, BLOCK_N, N, HALF)
    elif GATED:  # gate rows and their up rows (no split, no block scales: the host checks)
        offs_n, mask_n = _gated_rows(pid_n, N, BLOCK_N)
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
    offs_m = tl.arange(0, M_PAD)
    mask_m = offs_m < M
    k0 = pid_k * K_PER_SPLIT
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + (k0 + offs_k)[None, :]
    x_ptrs = X + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :]
    if F16:
        acc = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
    elif M_PAD == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    if PDL:
        # The weights are nobody's output: the first PRE tiles stream in while the previous kernel drains
        # (PRE = 2 only where this split has two tiles or more: the host checks).
        pdl_trigger_early(PDL)
        w = _load_w(w_ptrs, k0, K, mask_n, offs_k, EVEN_K, "evict_first")
        if PRE == 2:
            w2 = _load_w(w_ptrs + BLOCK_K, k0 + BLOCK_K, K, mask_n, offs_k, EVEN_K, "evict_first")
        pdl_prologue(PDL, True)
        acc = _accumulate(acc, w, x_ptrs, k0, K, mask_m, offs_k, M_PAD, EVEN_K, SILU_MUL, DOT_PREC, F16, S,
                          stride_s, offs_n, mask_n, BLOCK_N, SBN, SBK)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        if PRE == 2:
            acc = _accumulate(acc, w2, x_ptrs, k0 + BLOCK_K, K, mask_m, offs_k, M_PAD, EVEN_K, SILU_MUL,
                              DOT_PREC, F16, S, stride_s, offs_n, mask_n, BLOCK_N, SBN, SBK)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
    rs, r_in, gamma, cos, sin, slot = _epilogue_inputs(pid_n, offs_n, mask_n, N, K, R, GAMMA, SQ, eps, POS, CS,
                                                       stride_cs, LOC, QS, KVS, NORM_IN,
                                                       ADD_NORM and (SPLIT_K == 1 or TICKETED),
                                                       ROPE and M == 1, NSLOT, BLOCK_N, HALF)
    for kk in range(PRE * BLOCK_K if PDL else 0, K_PER_SPLIT, BLOCK_K):
        w = _load_w(w_ptrs, k0 + kk, K, mask_n, offs_k, EVEN_K, "evict_first")
        acc = _accumulate(acc, w, x_ptrs, k0 + kk, K, mask_m, offs_k, M_PAD, EVEN_K, SILU_MUL, DOT_PREC, F16, S,
                          stride_s, offs_n, mask_n, BLOCK_N, SBN, SBK)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if F16:
        acc = tl.sum(acc, axis=1)[None, :] * 256.0
    elif M_PAD == 1:
        acc = tl.sum(acc, axis=1)[None, :]
    if HAS_SCALE:  # FP8 weights: one dequantization scale per output row (linear, so per split too)
        acc = acc * tl.load(S + offs_n, mask=mask_n, other=0.0)[None, :]
    if NORM_IN:  # linear in x: a split's partial takes the scale too
        acc = acc * rs
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1 and ADD_NORM:  # one row (the host checks): acc's other rows are zero
        _add_norm_epilogue(tl.sum(acc, axis=0), r_in, gamma, offs_n, mask_n, pid_n, R, Y, SQ, NSLOT)
    elif ROPE and M == 1:
        rope_store_epilogue(tl.sum(acc, axis=0), cos, sin, slot, pid_n, N, Y, KB, VB, stride_bs, QS, KVS, BLOCK_N,
                            HALF)
    elif ROPE:  # several rows (unsplit: the host checks), each at its own position and slot
        rope_store_rows(acc, offs_m, mask_m, pid_n, N, POS, CS, stride_cs, LOC, Y, stride_ym, KB, VB, stride_bs, QS,
                        KVS, BLOCK_N, HALF)
    elif GATED and M == 1:
        _gated_epilogue(tl.sum(acc, axis=0), pid_n, N, X, Y, BLOCK_N)
    elif GATED:
        _gated_rows_epilogue(acc, offs_m, mask_m, pid_n, N, X, Y, stride_ym, BLOCK_N)
    elif SPLIT_K == 1:
        tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], _out(acc, X, Y), mask=mask)
    else:
        tl.store(P + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)
        if TICKETED:  # one row (the host checks): the tile's last split to finish sums them, as the reduce kernel
            # Every thread's partial stored before one thread takes the ticket (acq_rel at GPU scope: a release of
            # them, and for the last taker an acquire of the others'); the counter is put back to 0 for the next
            # launch (a later layer, step or graph replay), which starts only after this grid completes.
            tl.debug_barrier()
            ticket = TK + pid_n
            if tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
                total = _sum_splits(P, 0, N, offs_n, mask_n, M, SPLIT_K, BLOCK_N, ".cg")
                if ADD_NORM:
                    _add_norm_epilogue(total, r_in, gamma, offs_n, mask_n, pid_n, R, Y, SQ, NSLOT)
                else:
                    tl.store(Y + offs_n, _out(total, X, Y), mask=mask_n)
                tl.store(ticket, 0)


@triton.jit
def _row_x(x_ptrs, kbase, K, offs_k, EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr):
    """One row of x for a weight tile, in w's register layout (_row_tile)."""
    # Plain loads (no cache-policy hint, which Triton emits as inline assembly): the compiler then sees the
    # rows' x loads as one and converts each x element once, not once per row a thread holds.
    if EVEN_K:
        x = tl.load(x_ptrs)
    else:
        xm = (kbase + offs_k)[None, :] < K
        x = tl.load(x_ptrs, mask=xm, other=0.0)
    if SILU_MUL:
        if EVEN_K:
            up = tl.load(x_ptrs + K)
        else:
            up = tl.load(x_ptrs + K, mask=xm, other=0.0)
        x = _silu_mul(x, up)
    return x


@triton.jit
def _row_acc(acc, w, x, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NARROW: tl.constexpr, F16: tl.constexpr):
    if F16:  # FP8 weights multiplied in f16, eight products summed there (as _accumulate's F16 path)
        p = w.to(tl.float16) * (x.to(tl.float32) * 0.00390625).to(tl.float16)
        acc += _pair_sum(_pair_sum(_pair_sum(p))).to(tl.float32)
    elif NARROW:  # each thread's eight neighbouring products summed first: an eighth of the accumulators
        p = w.to(tl.float32) * x.to(tl.float32)
        acc += tl.sum(tl.reshape(p, (BLOCK_N, BLOCK_K // 8, 8)), axis=2)
    else:
        acc += w.to(tl.float32) * x.to(tl.float32)
    return acc


@triton.jit
def _row_sums(acc, S, offs_n, mask_n, F16: tl.constexpr, HAS_SCALE: tl.constexpr):
    """A row's accumulators reduced across K: f16 products' 2^8 undone, FP8 rows' scales applied (linear, so per
    split too)."""
    out = tl.sum(acc, axis=1)
    if F16:
        out = out * 256.0
    if HAS_SCALE:
        out = out * tl.load(S + offs_n, mask=mask_n, other=0.0)
    return out


@triton.jit
def _row_tile(acc, w_ptrs, x_ptrs, kbase, K, mask_n, offs_k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr, NARROW: tl.constexpr, EVICT: tl.constexpr, w=None,
              F16: tl.constexpr = False, acc2=None, XS=0, ROWS: tl.constexpr = 1):
    """One [BLOCK_N, BLOCK_K] weight tile of a one-row GEMV added into acc (and with ROWS = 2 into acc2 for x's
    second row, XS elements further on: the tile read once for both). x is read through a pointer tile of w's
    shape or, where every warp spans K, one broadcast row (_gemv_row_kernel): either way it arrives in w's
    register layout, with no layout conversion through shared memory in the loop."""
    if w is None:
        w = _load_w(w_ptrs, kbase, K, mask_n, offs_k, EVEN_K, EVICT)
    acc = _row_acc(acc, w, _row_x(x_ptrs, kbase, K, offs_k, EVEN_K, SILU_MUL), BLOCK_N, BLOCK_K, NARROW, F16)
    if ROWS == 2:
        acc2 = _row_acc(acc2, w, _row_x(x_ptrs + XS, kbase, K, offs_k, EVEN_K, SILU_MUL), BLOCK_N, BLOCK_K, NARROW,
                        F16)
    return acc, acc2


@triton.jit
def _row_chunk(acc, w_ptrs, x_ptrs, kbase, K, mask_n, offs_k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               FOLD: tl.constexpr, EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr, NARROW: tl.constexpr,
               EVICT: tl.constexpr, PRE: tl.constexpr = 0, w0=None, w1=None, F16: tl.constexpr = False, acc2=None,
               XS=0, ROWS: tl.constexpr = 1):
    """FOLD consecutive tiles, unrolled (their loads issue together); the first PRE of them already loaded
    (w0, w1). Returns (acc, acc2)."""
    for j in tl.static_range(FOLD):
        if j == 0 and PRE >= 1:
            w = w0
        elif j == 1 and PRE >= 2:
            w = w1
        else:
            w = None
        acc, acc2 = _row_tile(acc, w_ptrs, x_ptrs, kbase, K, mask_n, offs_k, BLOCK_N, BLOCK_K, EVEN_K, SILU_MUL,
                              NARROW, EVICT, w, F16, acc2, XS, ROWS)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        kbase += BLOCK_K
    return acc, acc2


@triton.jit
def _gemv_row_kernel(X, W, Y, P, S, N, K, stride_wn, K_PER_SPLIT, R, GAMMA, SQ, eps,
                     POS, CS, stride_cs, LOC, KB, VB, stride_bs, QS, KVS,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
                     SILU_MUL: tl.constexpr, PDL: tl.constexpr, PRE: tl.constexpr, FOLD: tl.constexpr,
                     X_ROWS: tl.constexpr, NARROW: tl.constexpr, EVICT: tl.constexpr, NORM_IN: tl.constexpr = False,
                     ADD_NORM: tl.constexpr = False, NSLOT: tl.constexpr = 16, ROPE: tl.constexpr = False,
                     HALF: tl.constexpr = 1, HAS_SCALE: tl.constexpr = False, F16: tl.constexpr = False,
                     W_VEC: tl.constexpr = 0, GATED: tl.constexpr = False, ROWS: tl.constexpr = 1, stride_xm=0,
                     stride_ym=0):
    """y = x @ W^T for one row x and half-, full-precision or FP8 W (HAS_SCALE: one dequantization scale per
    output row; F16: multiplied in f16, eight products summed there): each program streams BLOCK_N rows of W
    over its K split, FOLD tiles a loop step, into fp32 accumulators reduced across K once at the end.
    ROWS = 2: two rows of x (stride_xm apart; y's stride_ym) against each weight tile, a second accumulator; the rope
    (each row at its own position and slot), gating and split-norm epilogues (each row its own partials), K unsplit
    with any of them (the host checks)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if ROPE:  # whole rotary pairs a program (no split: the host checks)
        offs_n, mask_n = rope_rows(pid_n, BLOCK_N, N, HALF)
    elif GATED:  # gate rows and their up rows (no split: the host checks)
        offs_n, mask_n = _gated_rows(pid_n, N, BLOCK_N)
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    k0 = pid_k * K_PER_SPLIT
    # FP8 weights: 8 bytes a thread a row (W_VEC = 8), so that w and the bf16 x row take the same register layout and
    # the weights are not converted to x's through shared memory (the widest loads, 16 fp8 a thread, would be).
    offs_kw = tl.max_contiguous(offs_k, W_VEC) if W_VEC else offs_k
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + (k0 + offs_kw)[None, :]
    if X_ROWS:  # x through a pointer tile of w's shape: w's layout whatever the warps' placement
        x_ptrs = X + (k0 + offs_k)[None, :] + 0 * offs_n[:, None]
    else:  # one x row, broadcast: w's layout where every warp spans K (then x is converted once a tile)
        x_ptrs = X + (k0 + offs_k)[None, :]
    if NARROW or F16:
        acc = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if ROWS == 2:
        acc2 = tl.zeros(acc.shape, dtype=tl.float32)
    else:
        acc2 = tl.zeros((1,), dtype=tl.float32)  # carried, unused
    start = 0
    if PDL:
        # The weights are nobody's output: the first PRE tiles stream in while the previous kernel drains.
        pdl_trigger_early(PDL)
        w0 = _load_w(w_ptrs, k0, K, mask_n, offs_k, EVEN_K, EVICT)
        if PRE == 2:
            w1 = _load_w(w_ptrs + BLOCK_K, k0 + BLOCK_K, K, mask_n, offs_k, EVEN_K, EVICT)
        else:
            w1 = w0
        pdl_prologue(PDL, True)
        acc, acc2 = _row_chunk(acc, w_ptrs, x_ptrs, k0, K, mask_n, offs_k, BLOCK_N, BLOCK_K, FOLD, EVEN_K, SILU_MUL,
                               NARROW, EVICT, PRE, w0, w1, F16, acc2, stride_xm, ROWS)
        w_ptrs += FOLD * BLOCK_K
        x_ptrs += FOLD * BLOCK_K
        start = FOLD * BLOCK_K
    rs, r_in, gamma, cos, sin, slot = _epilogue_inputs(pid_n, offs_n, mask_n, N, K, R, GAMMA, SQ, eps, POS, CS,
                                                       stride_cs, LOC, QS, KVS, NORM_IN, ADD_NORM and SPLIT_K == 1,
                                                       ROPE, NSLOT, BLOCK_N, HALF)
    for kk in range(start, K_PER_SPLIT, FOLD * BLOCK_K):
        acc, acc2 = _row_chunk(acc, w_ptrs, x_ptrs, k0 + kk, K, mask_n, offs_k, BLOCK_N, BLOCK_K, FOLD, EVEN_K,
                               SILU_MUL, NARROW, EVICT, F16=F16, acc2=acc2, XS=stride_xm, ROWS=ROWS)
        w_ptrs += FOLD * BLOCK_K
        x_ptrs += FOLD * BLOCK_K
    out = _row_sums(acc, S, offs_n, mask_n, F16, HAS_SCALE)
    if NORM_IN:  # linear in x: a split's partial takes the scale too
        out = out * rs
    if SPLIT_K == 1 and ADD_NORM:
        _add_norm_epilogue(out, r_in, gamma, offs_n, mask_n, pid_n, R, Y, SQ, NSLOT)
    elif ROPE:
        rope_store_epilogue(out, cos, sin, slot, pid_n, N, Y, KB, VB, stride_bs, QS, KVS, BLOCK_N, HALF)
    elif GATED:
        _gated_epilogue(out, pid_n, N, X, Y, BLOCK_N)
    elif SPLIT_K == 1:
        tl.store(Y + offs_n, _out(out, X, Y), mask=mask_n)
    else:
        tl.store(P + pid_k * ROWS * N + offs_n, out, mask=mask_n)
    if ROWS == 2:  # the second row's sums and epilogue as the first's; its epilogues' inputs (norm partials, residual
        # row, position, slot) in the tail: its split-norm partials NSLOT after the first's, its residual row N after
        _later_row(acc2, 1, S, offs_n, mask_n, N, K, eps, pid_n, pid_k, X, Y, P, R, GAMMA, gamma, SQ, POS, CS,
                   stride_cs, LOC, KB, VB, stride_bs, QS, KVS, stride_ym, F16, HAS_SCALE, NORM_IN, ADD_NORM, ROPE,
                   GATED, SPLIT_K, NSLOT, BLOCK_N, HALF, ROWS)


@triton.jit
def _later_row(acc, r: tl.constexpr, S, offs_n, mask_n, N, K, eps, pid_n, pid_k, X, Y, P, R, GAMMA, gamma, SQ, POS,
               CS, stride_cs, LOC, KB, VB, stride_bs, QS, KVS, stride_ym, F16: tl.constexpr, HAS_SCALE: tl.constexpr,
               NORM_IN: tl.constexpr, ADD_NORM: tl.constexpr, ROPE: tl.constexpr, GATED: tl.constexpr,
               SPLIT_K: tl.constexpr, NSLOT: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr,
               ROWS: tl.constexpr):
    """Row r (>= 1) of a several-row _gemv_row_kernel: its sums and its epilogue, as the first row's (whose own ladder
    takes the inputs loaded ahead and the split partials, and whose code batch 1's measured SASS pins)."""
    out = _row_sums(acc, S, offs_n, mask_n, F16, HAS_SCALE)
    if NORM_IN:
        out = out * _norm_in_scale(SQ + r * NSLOT, K, eps, NSLOT)
    if ADD_NORM:  # unsplit (the host checks)
        r_in, _ = _add_norm_inputs(R + r * N, GAMMA, offs_n, mask_n)
        _add_norm_epilogue(out, r_in, gamma, offs_n, mask_n, pid_n, R + r * N, Y + r * stride_ym, SQ + r * NSLOT,
                           NSLOT)
    elif ROPE:
        cos, sin, slot = rope_store_inputs(pid_n, N, POS + r, CS, stride_cs, LOC + r, QS, KVS, BLOCK_N, HALF)
        rope_store_epilogue(out, cos, sin, slot, pid_n, N, Y + r * stride_ym, KB, VB, stride_bs, QS, KVS, BLOCK_N,
                            HALF)
    elif GATED:
        _gated_epilogue(out, pid_n, N, X, Y + r * stride_ym, BLOCK_N)
    elif SPLIT_K == 1:
        tl.store(Y + r * stride_ym + offs_n, _out(out, X, Y), mask=mask_n)
    else:
        tl.store(P + (pid_k * ROWS + r) * N + offs_n, out, mask=mask_n)


@triton.jit
def _splitk_reduce_kernel(X, P, Y, N, stride_ym, R, GAMMA, SQ, POS, CS, stride_cs, LOC, KB, VB, stride_bs, QS, KVS,
                          M: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                          ADD_NORM: tl.constexpr = False, NSLOT: tl.constexpr = 16, ROPE: tl.constexpr = False,
                          HALF: tl.constexpr = 1):
    pdl_prologue(PDL)
    m = tl.program_id(1)
    if ROPE:  # one row (the host checks)
        offs, mask = rope_rows(tl.program_id(0), BLOCK, N, HALF)
    else:
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
    if ADD_NORM:
        r_in, gamma = _add_norm_inputs(R, GAMMA, offs, mask)
    if ROPE:
        cos, sin, slot = rope_store_inputs(tl.program_id(0), N, POS, CS, stride_cs, LOC, QS, KVS, BLOCK, HALF)
    acc = _sum_splits(P, m, N, offs, mask, M, SPLIT_K, BLOCK, "")
    if ADD_NORM:  # one row (the host checks)
        _add_norm_epilogue(acc, r_in, gamma, offs, mask, tl.program_id(0), R, Y, SQ, NSLOT)
    elif ROPE:
        rope_store_epilogue(acc, cos, sin, slot, tl.program_id(0), N, Y, KB, VB, stride_bs, QS, KVS, BLOCK, HALF)
    else:
        tl.store(Y + m * stride_ym + offs, _out(acc, X, Y), mask=mask)


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    pre_tiles: int = 1  # weight tiles loaded before waiting on the previous kernel (PDL): 1 or 2
    f16_math: bool = False  # FP8 weights, one row: multiply in f16, eight products summed in f16 (_accumulate)
    # One row of x, half- or full-precision weights (_gemv_row_kernel unless row_kernel is False):
    fold: int = 1  # tiles a loop step unrolls (at least pre_tiles; lowered to a divisor of the split's tiles)
    row_kernel: bool = True
    narrow: bool = False  # each thread's eight neighbouring products summed before they are accumulated
    evict_first: bool = True  # weight loads marked evict-first (W is read once)


# K is split (a reduce kernel after) while the output's programs number fewer than this many per SM.
SPLIT_K_MIN_PROGRAMS = knob("SPLIT_K_MIN_PROGRAMS")
# The tile tables (kernels/configs/gemv.json, tile_table("gemv", name)) hold (block_n, block_k, num_warps) by the
# weight's (N, K): "bf16_rows" / "fp8_rows" for several rows on the tensor-core tile, by the weights' dtype; "two_row"
# / "two_row_fp8" for two rows on the one-row kernel. Shapes not listed take default_config's or two_row_config's rule.
# Split K without the reduce kernel (one row, the general kernel, no rope epilogue): each output tile's last split to
# finish, by a per-tile ticket counter, sums the splits' partials and runs the epilogue, as the reduce kernel would,
# bit for bit (a split norm's sum of squares is taken a tile at a time, as without split K: equal to fp32
# rounding). The counters are one buffer a device: ticketed GEMVs must not run concurrently on two streams of one
# device (the engine runs its forward passes on one stream).
_TICKET_SLOTS = 65536  # output tiles one launch may ticket (more run the reduce kernel)
_tickets: dict = {}


def _ticket_counters(device: torch.device) -> torch.Tensor:
    """One zeroed int32 counter a tile for every ticketed launch on the device, allocated once (a captured graph
    keeps its address) and left zero by each launch. Launches share it safely: a GEMV takes tickets only after
    its PDL wait, when the launch before it has completed."""
    t = _tickets.get(device)
    if t is None:
        t = _tickets[device] = torch.zeros(_TICKET_SLOTS, dtype=torch.int32, device=device)
    return t


def default_config(M: int, N: int, K: int, weight_bytes: int = 2, fp8_row: bool = False) -> GemvConfig:
    """Tiles swept in the 32-layer chain of Llama-8B's decode GEMVs, where a kernel's neighbours overlap it under PDL
    (docs/kernels.md). K is split only when N is too short to put two programs on every SM. Several rows run on
    tensor cores, which want >= 16 output columns per program. fp8_row: one FP8 row on the one-row kernel (the rule
    two_row_config starts from; one FP8 row alone runs on the general kernel)."""
    extra, no_split = {}, False
    if M == 1 and weight_bytes == 1 and fp8_row:
        # The bf16 row tiles' bytes a thread a loop step (256 on o_proj, down_proj and qkv, 128 on gate_up) at twice
        # the elements, two tiles before the PDL wait.
        if N <= 4096:
            block_n, block_k, warps = (4, 4096, 2) if K <= 4096 else (8, 2048, 2)
        else:
            block_n, block_k, warps = (8, 1024, 2) if N <= 8192 else (2, 4096, 2)
        extra = dict(f16_math=True, pre_tiles=2, fold=2 if 4096 < N <= 8192 else 1)
    elif M == 1 and weight_bytes == 1:
        # FP8 rows with f16 math on the general kernel, one tile before the PDL wait; down_proj's shape (long K)
        # unsplit, at 16 warps.
        down = N <= 8192 and K > 4096
        if down:
            block_n, block_k, warps = 16, 2048, 16
        elif N > 8192:  # gate_up
            block_n, block_k, warps = 4, 2048, 2
        else:
            block_n, block_k, warps = (16, 1024, 8) if N <= 4096 else (8, 2048, 4)
        no_split = down
        extra = dict(f16_math=True, row_kernel=False)
    elif M == 1:
        # The one-row kernel: few rows and long K tiles a program, products summed eight at a time before they are
        # accumulated where registers are short, two tiles before the PDL wait.
        if N <= 4096:  # o_proj (K = N); down_proj (long K, the gated activation computed in the load)
            block_n, block_k, warps, narrow = (2, 4096, 2, True) if K <= 4096 else (8, 2048, 4, True)
        else:  # qkv; gate_up
            block_n, block_k, warps, narrow = (8, 512, 2, True) if N <= 8192 else (2, 2048, 2, False)
        extra = dict(pre_tiles=2, fold=2 if 4096 < N <= 8192 else 1, narrow=narrow)
    else:
        if weight_bytes == 1:
            block_n, block_k, warps = tile_table("gemv", "fp8_rows").get((N, K)) or (
                (32, 512, 4) if N <= 4096 else (64, 512, 4) if N <= 8192 else (64, 256, 4))
        else:  # (32, 128, 4): the sweep's best on three of Llama-8B's four shapes, within 8% on the fourth
            block_n, block_k, warps = tile_table("gemv", "bf16_rows").get((N, K), (32, 128, 4))
        if M > 16:  # a 32- or 64-row x tile: 512-wide K tiles would take 260-330 KB of shared memory (sm_90 compile)
            block_k = min(block_k, 256)
    block_k = min(block_k, max(16, next_pow2(K)))
    split_k = 1 if no_split else split_k_for(N, block_n, K, block_k)
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=warps, **extra)


def two_row_config(N: int, K: int, weight_bytes: int = 2) -> GemvConfig:
    """Two rows' tiles on the one-row kernel: the "two_row" ("two_row_fp8") table's where listed, else the one-row
    kernel's with narrow accumulators and half the K tile (at least 256), which keeps the two rows' registers near one
    row's (at the one-row tiles gate_up spilled on sm_90). FP8 weights start from the FP8 one-row-kernel tiles
    (default_config's fp8_row) by the same rule."""
    cfg = default_config(1, N, K, weight_bytes, fp8_row=True)
    if not cfg.row_kernel:
        return cfg
    table = tile_table("gemv", "two_row" if weight_bytes > 1 else "two_row_fp8")
    if (N, K) in table:
        block_n, block_k, warps = table[N, K]
        return dataclasses.replace(cfg, block_n=block_n, block_k=block_k, num_warps=warps, narrow=True, fold=1,
                                   split_k=split_k_for(N, block_n, K, block_k))
    block_k, warps = (max(256, cfg.block_k // 2) if cfg.block_k > 256 else cfg.block_k), cfg.num_warps
    if weight_bytes == 1:  # FP8's row tiles hold twice the elements: at most 64 weights a thread a tile, by more warps
        # (up to 4), then shorter K tiles (o_proj at (4, 2048, 2) spilled on sm_90)
        while cfg.block_n * block_k > 64 * 32 * warps and warps < 4:
            warps *= 2
        while cfg.block_n * block_k > 64 * 32 * warps and block_k > 256:
            block_k //= 2
    return dataclasses.replace(cfg, narrow=True, block_k=block_k, num_warps=warps,
                               split_k=split_k_for(N, cfg.block_n, K, block_k))


def split_k_for(N: int, block_n: int, K: int, block_k: int) -> int:
    """default_config's split of K for a tile: halved until the output's programs number SPLIT_K_MIN_PROGRAMS an SM,
    while each split keeps one K tile or more (at most 16 splits)."""
    split_k, k_steps = 1, triton.cdiv(K, block_k)
    while (triton.cdiv(N, block_n) * split_k < SPLIT_K_MIN_PROGRAMS * num_sms() and split_k * 2 <= k_steps
           and split_k < 16):
        split_k *= 2
    return split_k


def _norm_args(norm_in: ResidualNorm | None, add_norm: ResidualNorm | None, split_k: int, x: torch.Tensor) -> dict:
    """The split residual norm's pointers and switches for the GEMV kernels (the producer's epilogue runs where
    the output is complete: in the reduce kernel under split-K)."""
    norm = norm_in or add_norm
    return dict(R=add_norm.residual if add_norm is not None else x, GAMMA=add_norm.weight if add_norm is not None else x,
                SQ=norm.sumsq if norm is not None else x, eps=norm.eps if norm is not None else 0.0,
                NORM_IN=norm_in is not None, ADD_NORM=add_norm is not None and split_k == 1, NSLOT=NORM_SLOTS)


def _programs_n(N: int, block_n: int, gated_out: bool) -> int:
    """Programs along N: gated ones take block_n / 2 of the I = N / 2 gate rows (and as many up rows) each."""
    return triton.cdiv(N // 2, block_n // 2) if gated_out else triton.cdiv(N, block_n)


def _f16_math(cfg: GemvConfig, w: torch.Tensor) -> bool:
    return cfg.f16_math and w.element_size() == 1 and cfg.block_k >= 8


def _gemv_row(x, w, out, partial, scale, N, K, k_per_split, split_k, even_k, cfg: GemvConfig, silu_mul, pdl, norms,
              ropes, gated_out=False, rows: int = 1):
    tiles = k_per_split // cfg.block_k
    # With PDL the first chunk is peeled to take the tiles loaded before the wait, so it holds pre_tiles (the
    # chunking does not depend on PDL: the same sums in the same order either way).
    fold = min(max(cfg.fold, cfg.pre_tiles), tiles)
    while tiles % fold:
        fold -= 1
    launch = pdl_launch(pdl, "gemv")
    # FP8 weights against a 16-bit x: 8 weights a thread a load, x's layout (_gemv_row_kernel's W_VEC).
    w_vec = 8 if w.element_size() == 1 and x.element_size() == 2 else 0
    _gemv_row_kernel[(_programs_n(N, cfg.block_n, gated_out), split_k)](
        x, w, out, partial, scale if scale is not None else w, N, K, w.stride(0), k_per_split, **norms, **ropes,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split_k, EVEN_K=even_k, SILU_MUL=silu_mul,
        PRE=min(cfg.pre_tiles, fold) if launch["PDL"] else 0, FOLD=fold,
        # Whether the CTA's threads, at one vector of w each, cover more than one tile row along K.
        X_ROWS=cfg.block_k < 32 * cfg.num_warps * (w_vec or 16 // w.element_size()),
        NARROW=cfg.narrow and cfg.block_k % 8 == 0, EVICT="evict_first" if cfg.evict_first else "",
        HAS_SCALE=scale is not None, F16=_f16_math(cfg, w), W_VEC=w_vec, GATED=gated_out, ROWS=rows,
        stride_xm=x.stride(0), stride_ym=out.stride(0), num_warps=cfg.num_warps, **launch)


def _two_row_tile(M: int, N: int, K: int, weight_bytes: int, config: GemvConfig | None, tensor_cores: bool,
                  block) -> GemvConfig | None:
    """The tile M rows take on the one-row kernel (config, or two_row_config's): two rows without block scales, at a
    row kernel's tile; None where they take another kernel."""
    if not (M == 2 and not tensor_cores and block is None):
        return None
    cfg = config or two_row_config(N, K, weight_bytes)
    return cfg if cfg.row_kernel else None


def on_tensor_cores(M: int, w: torch.Tensor, scale: torch.Tensor | None = None) -> bool:
    """Whether gemv (default tiles) runs M rows against w on the
    tensor-core tile, where an activation computed in the load (silu_mul) would be computed for all 16 padded rows by
    every program along N: not one row, nor two that take the one-row kernel (kernels.ops.silu_mul_linear and
    two_row_gating_applies ask)."""
    if M == 1:
        return False
    block = scale_block(w, scale) if scale is not None else None
    return _two_row_tile(M, w.shape[0], w.shape[1], w.element_size(), None, False, block) is None


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
         config: GemvConfig | None = None, scale: torch.Tensor | None = None,
         tensor_cores: bool = False, silu_mul: bool = False, pdl: bool | None = None,
         norm_in: ResidualNorm | None = None, add_norm: ResidualNorm | None = None,
         rope: RopeStore | None = None, gated_out: bool = False) -> torch.Tensor:
    """y = x @ w^T for x [M, K] (M <= MAX_M), w [N, K] with contiguous rows; y in x's dtype (or in `out`'s: x's
    rounding held in a wider dtype, as the lm_head's fp32 logits).
    `scale` (float32 [N]) dequantizes FP8 weights row by row (x is not quantized: several rows multiply the weight
    tiles widened to x's dtype on tensor cores); a scale [N / bn, K / bk] block by block (one row;
    kernels.reference.scale_block).
    silu_mul: x is [M, 2K] (gate | up) and y = silu_and_mul(x) @ w^T.
    pdl: programmatic dependent launch (None: the process default; see kernels._utils.pdl_launch).
    A residual RMSNorm split around this GEMV (one row; kernels/residual_norm.py): with `norm_in` x is the
    producer's gamma * residual and y is scaled by the norm's rsqrt(mean(residual^2) + eps); with `add_norm`
    y is added into add_norm.residual (in place) and the GEMV returns gamma * residual instead.
    rope (kernels/rope_store.py): w is a qkv projection; y's q and k come out rotated at each token's position and
    k, v are also written to its pool slot.
    gated_out: w is a gated MLP's gate | up projection [2I, K]; returns silu_and_mul(y) [M, I], the gating in the
    GEMV's epilogue (K unsplit; no split norm's producer, rope or block scales)."""
    M, K = x.shape
    if silu_mul:
        assert K % 2 == 0
        K //= 2
    N = w.shape[0]
    assert M <= MAX_M, f"gemv is for decode batches of at most {MAX_M} rows; use a GEMM"
    assert w.shape[1] == K and w.stride(1) == 1 and x.stride(1) == 1
    block = scale_block(w, scale) if scale is not None else None
    assert scale is None or scale.dtype == torch.float32
    assert block is not None or scale is None or scale.shape == (N,)
    assert scale is None or x.dtype in (torch.bfloat16, torch.float16, torch.float32), \
        "FP8 weights multiply an unquantized x of a float dtype"
    assert block is None or (M == 1 and not tensor_cores and block[1] % 8 == 0 and scale.stride(1) == 1), \
        "block-scaled FP8 weights: one row, blocks of whole eight-input lanes"
    assert norm_in is None or add_norm is None, "a GEMV consumes one split norm or produces one, not both"
    assert add_norm is None or (add_norm.rows == M and add_norm.size == N and add_norm.residual.dtype == x.dtype)
    assert norm_in is None or (norm_in.rows == M and norm_in.size == K)
    assert rope is None or (rope.size == N and add_norm is None and not silu_mul
                            and rope.positions.shape[0] == M == rope.loc.shape[0])
    assert not gated_out or (N % 2 == 0 and block is None and add_norm is None and rope is None and not silu_mul
                             and not tensor_cores), \
        "gated_out: a gate | up projection, per-row scales, no producer epilogue"
    # Two rows on the one-row kernel at two_row_config's tiles (or a given row-kernel config): each weight tile read
    # once for both, every epilogue each row's own.
    row_cfg = _two_row_tile(M, N, K, w.element_size(), config, tensor_cores, block)
    two_rows = row_cfg is not None
    assert M == 1 or two_rows or (norm_in is None and add_norm is None), \
        "split norms: one row, or two on the one-row kernel"
    cfg = row_cfg if two_rows else config or default_config(M, N, K, w.element_size())
    if gated_out:  # a program owns whole gate/up pairs, over all of K (the epilogue needs complete sums; a tile that
        # would split K, none of Llama-8B's gate_up tiles at batch 1, gives up that parallelism here)
        cfg = dataclasses.replace(cfg, block_n=max(2, cfg.block_n), split_k=1)
    if M > 1 and (rope is not None or norm_in is not None or add_norm is not None):  # several rows rotate, and two
        # rows run their norms, in the GEMV's own epilogue (the reduce kernel's, and a split's scale, are one row's)
        cfg = dataclasses.replace(cfg, split_k=1)
    if block is not None:  # the general kernel's f16 lanes take the block scales
        cfg = dataclasses.replace(cfg, row_kernel=False, f16_math=True)
    dot = (M > 1 and not two_rows) or tensor_cores
    if dot and cfg.block_n < 16:  # tensor-core tile minimum
        cfg = dataclasses.replace(cfg, block_n=16)
    assert rope is None or cfg.block_n % 2 == 0, "rope: a program owns whole rotary pairs"
    if out is None:
        out = torch.empty((M, N // 2 if gated_out else N), dtype=x.dtype, device=x.device)
    assert not gated_out or (out.shape == (M, N // 2) and out.stride(1) == 1), "gated_out: out is [M, N / 2]"
    k_per_split = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    split_k = triton.cdiv(K, k_per_split)
    even_k = K % cfg.block_k == 0 and K % k_per_split == 0
    partial = (torch.empty((split_k, M, N), dtype=torch.float32, device=x.device) if split_k > 1 else out)
    ticketed = bool(split_k > 1 and rope is None and triton.cdiv(N, cfg.block_n) <= _TICKET_SLOTS
                    and M == 1 and not dot and not cfg.row_kernel)
    norms = _norm_args(norm_in, add_norm, 1 if ticketed else split_k, x)
    ropes = rope_args(rope, x, split_k == 1)
    if not dot and cfg.row_kernel:
        _gemv_row(x, w, out, partial, scale, N, K, k_per_split, split_k, even_k, cfg, silu_mul, pdl, norms, ropes,
                  gated_out, rows=M)
    else:
        _gemv_kernel[(_programs_n(N, cfg.block_n, gated_out), split_k)](
            x, w, out, partial, scale if scale is not None else w, N, K, x.stride(0), w.stride(0), out.stride(0),
            k_per_split, **norms, **ropes, HAS_SCALE=scale is not None and block is None,
            stride_s=scale.stride(0) if block is not None else 0, SBN=block[0] if block else 0,
            SBK=block[1] if block else 0, M=M, M_PAD=max(16, next_pow2(M)) if dot else 1, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, SPLIT_K=split_k, EVEN_K=even_k, DOT_PREC=dot_precision(x.dtype), SILU_MUL=silu_mul,
            num_warps=cfg.num_warps, PRE=2 if cfg.pre_tiles >= 2 and k_per_split >= 2 * cfg.block_k else 1,
            F16=_f16_math(cfg, w) and not dot, TK=_ticket_counters(x.device) if ticketed else partial,
            TICKETED=ticketed, GATED=gated_out, **pdl_launch(pdl, "gemv"))
    if split_k > 1 and not ticketed:
        BLOCK = 1024
        _splitk_reduce_kernel[(triton.cdiv(N, BLOCK), M)](
            x, partial, out, N, out.stride(0), norms["R"], norms["GAMMA"], norms["SQ"], **rope_args(rope, x, True), M=M,
            SPLIT_K=split_k, BLOCK=BLOCK, num_warps=4, ADD_NORM=add_norm is not None, NSLOT=NORM_SLOTS,
            **pdl_launch(pdl, "gemv"))
    return out
