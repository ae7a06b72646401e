"""Rotary embedding, neox style (HF Llama's rotate_half), applied in place to q and k; optionally fused
with the KV store (apply_rope_and_store_kv: one launch instead of rope + store_kv per layer).

cos_sin_cache: [max_positions, rotary_dim] fp32, cos in the first half of each row and sin in the
second (kernels.reference.rope_cos_sin_cache builds it). Only the first rotary_dim dims of each head
rotate; the rest pass through.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._utils import next_pow2, pdl_launch, pdl_prologue
from kernels.kv_store import to_pool
from kernels.reference import inverse_scale


@triton.jit
def _rotate_heads(X, stride_h, Y, stride_yh, H, cos, sin, HALF, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):
    """Heads of one token read at X, rotated, written at Y (X itself for in place)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    mask = (offs_h[:, None] < H) & (offs_r[None, :] < HALF)
    p1 = X + offs_h[:, None] * stride_h + offs_r[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(X.dtype.element_ty)
    y2 = (x2 * cos + x1 * sin).to(X.dtype.element_ty)
    q1 = Y + offs_h[:, None] * stride_yh + offs_r[None, :]
    tl.store(q1, y1, mask=mask)
    tl.store(q1 + HALF, y2, mask=mask)
    return y1, y2


@triton.jit
def _copy_heads(X, stride_h, Y, stride_yh, H, lo, D, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr):
    """Dims [lo, D) of one token's heads copied from X to Y."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_c = lo + tl.arange(0, BLOCK_C)
    mask = (offs_h[:, None] < H) & (offs_c[None, :] < D)
    x = tl.load(X + offs_h[:, None] * stride_h + offs_c[None, :], mask=mask)
    tl.store(Y + offs_h[:, None] * stride_yh + offs_c[None, :], x, mask=mask)


@triton.jit
def _rope_token(Q, K, QO, KO, POS, CS, t, stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh,
                stride_okt, stride_okh, stride_cs, HQ, HK, HALF,
                BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr):
    """Token t's q and k heads rotated into QO / KO (Q / K for in place); returns k's rotated halves (in
    k's dtype)."""
    pos = tl.load(POS + t).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    cos = tl.load(CS + pos * stride_cs + offs_r, mask=offs_r < HALF, other=0.0)[None, :]
    sin = tl.load(CS + pos * stride_cs + HALF + offs_r, mask=offs_r < HALF, other=0.0)[None, :]
    _rotate_heads(Q + t * stride_qt, stride_qh, QO + t * stride_ot, stride_oh, HQ, cos, sin, HALF, BLOCK_HQ, BLOCK_R)
    return _rotate_heads(K + t * stride_kt, stride_kh, KO + t * stride_okt, stride_okh, HK, cos, sin, HALF,
                         BLOCK_HK, BLOCK_R)


@triton.jit
def _rope_kernel(Q, K, POS, CS, stride_qt, stride_qh, stride_kt, stride_kh, stride_cs, HQ, HK, HALF,
                 BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    _rope_token(Q, K, Q, K, POS, CS, t, stride_qt, stride_qh, stride_kt, stride_kh, stride_qt, stride_qh,
                stride_kt, stride_kh, stride_cs, HQ, HK, HALF, BLOCK_HQ, BLOCK_HK, BLOCK_R)


@triton.jit
def _rope_store_kv_kernel(Q, K, V, POS, CS, KB, VB, LOC, QO, KO, VO, inv_k_scale, inv_v_scale, stride_qt, stride_qh,
                          stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_bs, stride_bh, stride_ot,
                          stride_okt, HQ, HK, HALF, D, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, HAS_PASS: tl.constexpr,
                          OUT: tl.constexpr, PDL: tl.constexpr):
    """One token per program: rope on q and k exactly as _rope_kernel does (k rounded to its own dtype,
    then converted to the pool's by kv_store.to_pool, as rope followed by store_kv would), and k, v written to
    the token's slot.
    OUT: q, k, v written to the contiguous [T, H, D] tensors QO, KO, VO (whole heads, the unrotated tail
    too), Q and K left as they were; else q and k rotated in place."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(LOC + t).to(tl.int64)
    if OUT:
        y1, y2 = _rope_token(Q, K, QO, KO, POS, CS, t, stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, D,
                             stride_okt, D, stride_cs, HQ, HK, HALF, BLOCK_HQ, BLOCK_HK, BLOCK_R)
    else:
        y1, y2 = _rope_token(Q, K, Q, K, POS, CS, t, stride_qt, stride_qh, stride_kt, stride_kh, stride_qt,
                             stride_qh, stride_kt, stride_kh, stride_cs, HQ, HK, HALF, BLOCK_HQ, BLOCK_HK, BLOCK_R)
    offs_r = tl.arange(0, BLOCK_R)
    offs_h = tl.arange(0, BLOCK_HK)
    mask_h = offs_h[:, None] < HK
    dst = slot * stride_bs + offs_h[:, None] * stride_bh
    mask = mask_h & (offs_r[None, :] < HALF)
    tl.store(KB + dst + offs_r[None, :], to_pool(y1, inv_k_scale, KB.dtype.element_ty), mask=mask)
    tl.store(KB + dst + HALF + offs_r[None, :], to_pool(y2, inv_k_scale, KB.dtype.element_ty), mask=mask)
    if HAS_PASS:  # partial rotary: dims [2*HALF, D) are stored as they are
        offs_p = 2 * HALF + tl.arange(0, BLOCK_P)
        mask_p = mask_h & (offs_p[None, :] < D)
        kp = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_p[None, :], mask=mask_p)
        tl.store(KB + dst + offs_p[None, :], to_pool(kp, inv_k_scale, KB.dtype.element_ty), mask=mask_p)
        if OUT:
            tl.store(KO + t * stride_okt + offs_h[:, None] * D + offs_p[None, :], kp, mask=mask_p)
            _copy_heads(Q + t * stride_qt, stride_qh, QO + t * stride_ot, D, HQ, 2 * HALF, D, BLOCK_HQ, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = mask_h & (offs_d[None, :] < D)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask_d)
    tl.store(VB + dst + offs_d[None, :], to_pool(v, inv_v_scale, VB.dtype.element_ty), mask=mask_d)
    if OUT:
        tl.store(VO + t * stride_okt + offs_h[:, None] * D + offs_d[None, :], v, mask=mask_d)


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


def apply_rope_and_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                            cos_sin_cache: torch.Tensor, head_dim: int, k_buf: torch.Tensor,
                            v_buf: torch.Tensor, loc: torch.Tensor,
                            out: bool = False, k_scale: float = 1.0,
                            v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """apply_rope(q, k) then store_kv(k_buf, v_buf, loc, k, v) in one launch, with the same results bit
    for bit: the rotated k and v written to slots `loc` of the pool buffers [slots, Hkv, D]. q, k, v:
    [T, H*D] or [T, H, D] (strided views of a fused qkv output are fine). Returns (q, k, v): without
    `out`, q and k rotated in place and v itself; with it, new contiguous [T, H, D] tensors (q and k
    untouched), which extend attention reads faster than views whose rows lie a whole qkv row apart
    (docs/kernels.md). k_scale, v_scale: an FP8 pool's (kernels.kv_store.store_kv)."""
    sqt, sqh, hq = _head_strides(q, head_dim)
    skt, skh, hk = _head_strides(k, head_dim)
    svt, svh, hv = _head_strides(v, head_dim)
    half = cos_sin_cache.shape[1] // 2
    assert cos_sin_cache.stride(1) == 1 and 2 * half <= head_dim and hv == hk
    assert k_buf.is_contiguous() and v_buf.is_contiguous() and k_buf.shape[1:] == (hk, head_dim)
    T = q.shape[0]
    n_pass = head_dim - 2 * half
    if out:
        qo = torch.empty(T, hq, head_dim, dtype=q.dtype, device=q.device)
        ko, vo = (torch.empty(T, hk, head_dim, dtype=x.dtype, device=x.device) for x in (k, v))
    else:
        qo, ko, vo = q, k, v
    if T:
        _rope_store_kv_kernel[(T,)](
            q, k, v, positions, cos_sin_cache, k_buf, v_buf, loc, qo, ko, vo, inverse_scale(k_scale),
            inverse_scale(v_scale), sqt, sqh, skt, skh, svt, svh,
            cos_sin_cache.stride(0), k_buf.stride(0), k_buf.stride(1), hq * head_dim, hk * head_dim, hq, hk, half,
            head_dim, BLOCK_HQ=next_pow2(hq), BLOCK_HK=next_pow2(hk), BLOCK_R=next_pow2(half),
            BLOCK_D=next_pow2(head_dim), BLOCK_P=next_pow2(max(1, n_pass)), HAS_PASS=n_pass > 0, OUT=out,
            num_warps=4, **pdl_launch(family="rope"))
    return qo, ko, vo
