"""Paged decode attention (one query token per request), flash-decoding style.

Stage 1 splits each request's context into at most `max_kv_splits` chunks; one program handles one
(request, KV head, chunk) and all query heads of that KV head's group at once (GQA: K/V are read once
per group, and the group is padded to 16 rows so the scores are a tensor-core dot). It writes a
normalised partial output and its log-sum-exp. Stage 2 merges the chunks per (request, head).

With max_kv_splits == 1 (large batches already fill the GPU one program per request and KV head),
stage 1 writes the final output itself, merging a shared prefix's partials from the cascade kernel's
scratch columns where a request has them, and stage 2 is not launched.

CUDA-graph safe: the grid depends only on the batch size and max_kv_splits (host ints fixed per
graph); sequence lengths and per-request split counts are read from device tensors.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._utils import dot_precision, next_pow2, num_sms, pdl_launch, pdl_prologue

LOG2E = 1.4426950408889634


@triton.jit
def attend_chunk(q, KB, VB, ROW, start, end, kv_base, stride_bs, offs_d, mask_d, sm_scale_log2,
                 ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr):
    """Online-softmax attention of query rows q [ROWS, BLOCK_D] (in the KV dtype) over positions [start,
    end) of one req_to_token row (ROW points at it), KV head at kv_base: the normalised partial output
    [ROWS, BLOCK_D] fp32 and its log2-sum-exp [ROWS] (-inf, and an output of 0, for an empty chunk).
    The decode and shared-prefix kernels' one inner loop."""
    m_i = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((ROWS,), dtype=tl.float32)
    acc = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = tl.load(ROW + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_off = kv_base + slots[:, None] * stride_bs + offs_d[None, :]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(KB + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * sm_scale_log2
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(VB + kv_off, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    lse = tl.where(start >= end, float("-inf"), m_i + tl.log2(l_safe))
    return acc / l_safe[:, None], lse


@triton.jit
def _decode_stage1(Q, KB, VB, REQ_TO_TOKEN, REQ_IDX, SEQ_LENS, NUM_SPLITS, MID_O, MID_LSE, KV_START, O,
                   sm_scale_log2, stride_qb, stride_qh, stride_bs, stride_bh, stride_rt, stride_ob, stride_oh,
                   HQ, MAX_SPLITS, GROUP, D,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                   DOT_PREC: tl.constexpr, HAS_START: tl.constexpr, SINGLE: tl.constexpr, PDL: tl.constexpr):
    """SINGLE: one split per request, whose normalised output is final: written to O in O's dtype (as
    stage 2 would write it: a lone split merges to itself exactly), nothing to the scratch; with
    HAS_START, a request with a shared prefix merges the prefix's partials from the scratch first."""
    pdl_prologue(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SEQ_LENS + b)
    n_splits = tl.load(NUM_SPLITS + b)
    if split < n_splits:
        # Positions [kv_start, seq_len) (kv_start > 0: a shared prefix attended by the cascade kernel).
        kv_start = 0
        if HAS_START:
            kv_start = tl.load(KV_START + b)
        # Chunks are whole BLOCK_N tiles so only the context's last tile needs masking.
        split_len = tl.cdiv(tl.cdiv(seq_len - kv_start, n_splits), BLOCK_N) * BLOCK_N
        start = kv_start + split * split_len
        end = tl.minimum(start + split_len, seq_len)

        offs_g = tl.arange(0, BLOCK_H)
        heads = kvh * GROUP + offs_g
        mask_h = offs_g < GROUP
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        mask_hd = mask_h[:, None] & mask_d[None, :]
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_hd, other=0.0)
        q = q.to(KB.dtype.element_ty)
        row = tl.load(REQ_IDX + b).to(tl.int64) * stride_rt
        # A chunk past the end of a short context is empty: weight 0 in the merge (lse -inf, o 0).
        o, lse = attend_chunk(q, KB, VB, REQ_TO_TOKEN + row, start, end, kvh * stride_bh, stride_bs, offs_d, mask_d,
                              sm_scale_log2, BLOCK_H, BLOCK_D, BLOCK_N, DOT_PREC)
        if SINGLE:
            # A zero-length (padding) request has o = 0: zeros, as stage 2 writes for it.
            if HAS_START:
                if kv_start > 0:
                    # Merge the shared prefix's partials, columns [1, MAX_SPLITS) (the cascade kernel ran
                    # first), as stage 2 would: weights relative to the largest log-sum-exp.
                    base = (b * HQ + heads) * MAX_SPLITS
                    m = lse
                    for c in range(1, MAX_SPLITS):
                        m = tl.maximum(m, tl.load(MID_LSE + base + c, mask=mask_h, other=float("-inf")))
                    m = tl.where(m > float("-inf"), m, 0.0)
                    w = tl.where(lse > float("-inf"), tl.exp2(lse - m), 0.0)
                    num = o * w[:, None]
                    den = w
                    for c in range(1, MAX_SPLITS):
                        lc = tl.load(MID_LSE + base + c, mask=mask_h, other=float("-inf"))
                        wc = tl.where(lc > float("-inf"), tl.exp2(lc - m), 0.0)
                        oc = tl.load(MID_O + (base + c)[:, None] * D + offs_d[None, :],
                                     mask=mask_hd & (lc > float("-inf"))[:, None], other=0.0)
                        num += wc[:, None] * oc
                        den += wc
                    o = num / tl.where(den > 0, den, 1.0)[:, None]
            tl.store(O + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                     o.to(O.dtype.element_ty), mask=mask_hd)
        else:
            idx = (b * HQ + heads) * MAX_SPLITS + split
            tl.store(MID_O + idx[:, None] * D + offs_d[None, :], o, mask=mask_hd)
            tl.store(MID_LSE + idx, lse, mask=mask_h)


@triton.jit
def _decode_stage2(MID_O, MID_LSE, NUM_SPLITS, KV_START, O, stride_ob, stride_oh, HQ, MAX_SPLITS, EXTRA_FROM, D,
                   BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_START: tl.constexpr, PDL: tl.constexpr):
    """Columns [0, n_splits) of a row are merged, and for a request with a shared prefix (kv_start > 0)
    also [EXTRA_FROM, MAX_SPLITS): the prefix's partials (-inf where a chunk was empty)."""
    pdl_prologue(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    n_splits = tl.load(NUM_SPLITS + b)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < n_splits
    if HAS_START:
        mask_s = mask_s | ((offs_s >= EXTRA_FROM) & (offs_s < MAX_SPLITS) & (tl.load(KV_START + b) > 0))
    mask_d = offs_d < D
    idx = (b * HQ + h) * MAX_SPLITS + offs_s
    lse = tl.load(MID_LSE + idx, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, axis=0)
    # All chunks empty only for a zero-length (padding) request: output zeros, not NaN.
    w = tl.where(lse > float("-inf"), tl.exp2(lse - tl.where(m > float("-inf"), m, 0.0)), 0.0)
    # Columns without weight are never read: a prefix column no group wrote holds whatever was there.
    live = mask_s & (lse > float("-inf"))
    o = tl.load(MID_O + idx[:, None] * D + offs_d[None, :], mask=live[:, None] & mask_d[None, :], other=0.0)
    denom = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(denom > 0, denom, 1.0)
    tl.store(O + b * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=mask_d)


MIN_TOKENS_PER_SPLIT = 64
MAX_KV_SPLITS = 64


def plan_max_kv_splits(batch_size: int, num_kv_heads: int, cap: int = MAX_KV_SPLITS) -> int:
    """Splits per request so that batch * kv_heads * splits fills the GPU ~4 programs per SM.
    A host int of the batch size alone, hence fixed for a captured graph."""
    want = math.ceil(4 * num_sms() / max(1, batch_size * num_kv_heads))
    return max(1, min(cap, next_pow2(want)))


def num_kv_splits_for(seq_lens: torch.Tensor, max_kv_splits: int,
                      min_tokens_per_split: int = MIN_TOKENS_PER_SPLIT) -> torch.Tensor:
    """Per-request split count on device (no sync): short contexts use fewer chunks."""
    n = torch.div(seq_lens + (min_tokens_per_split - 1), min_tokens_per_split, rounding_mode="floor")
    return n.clamp(1, max_kv_splits).to(torch.int32)


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, num_kv_splits: torch.Tensor,
                     max_kv_splits: int, scaling: float, out: torch.Tensor | None = None,
                     mid_o: torch.Tensor | None = None, mid_lse: torch.Tensor | None = None,
                     kv_start: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, Hq, D]; pool buffers [slots, Hkv, D]; returns [B, Hq, D] in q's dtype.
    mid_o [B, Hq, S, D] / mid_lse [B, Hq, S] fp32 scratch (S >= max_kv_splits) may be passed in so all
    layers reuse one allocation. With kv_start [B] int32, only positions [kv_start, seq_len) are read
    here, and for requests with kv_start > 0 columns [max_kv_splits, S) of the scratch, filled
    beforehand (triton_cascade.py), are merged in as well. With max_kv_splits == 1 one launch writes
    `out` directly (merging those columns itself), and without kv_start the scratch is not needed."""
    B, HQ, D = q.shape
    HKV = k_buf.shape[1]
    assert HQ % HKV == 0 and q.stride(-1) == 1 and k_buf.is_contiguous() and v_buf.is_contiguous()
    group = HQ // HKV
    if out is None:
        out = torch.empty_like(q)
    single = max_kv_splits == 1
    assert kv_start is None or mid_lse is not None, "shared-prefix partials come in the scratch"
    if mid_o is None and not single:
        mid_o = torch.empty((B, HQ, max_kv_splits, D), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((B, HQ, max_kv_splits), dtype=torch.float32, device=q.device)
    if B == 0:
        return out
    total_splits = mid_lse.shape[2] if mid_lse is not None else 1
    assert total_splits == max_kv_splits or kv_start is not None
    BLOCK_D = max(16, next_pow2(D))
    BLOCK_N = 64 if BLOCK_D <= 128 else 32
    _decode_stage1[(B, HKV, max_kv_splits)](
        q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, num_kv_splits,
        mid_o if mid_o is not None else out, mid_lse if mid_lse is not None else out,
        kv_start if kv_start is not None else seq_lens, out,
        scaling * LOG2E, q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), req_to_token.stride(0),
        out.stride(0), out.stride(1), HQ, total_splits, group, D,
        BLOCK_H=max(16, next_pow2(group)), BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
        DOT_PREC=dot_precision(q.dtype), num_warps=4, num_stages=2, HAS_START=kv_start is not None,
        SINGLE=single, **pdl_launch())
    if single:
        return out
    _decode_stage2[(B, HQ)](
        mid_o, mid_lse, num_kv_splits, kv_start if kv_start is not None else seq_lens, out, out.stride(0),
        out.stride(1), HQ, total_splits, max_kv_splits, D, BLOCK_S=next_pow2(total_splits), BLOCK_D=BLOCK_D,
        num_warps=4 if BLOCK_D >= 128 else 2, HAS_START=kv_start is not None, **pdl_launch())
    return out
