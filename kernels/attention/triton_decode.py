"""Paged decode attention (one query token per request), flash-decoding style.

Stage 1 splits each request's context into at most `max_kv_splits` chunks; one program handles one
(request, KV head, chunk) and all query heads of that KV head's group at once (GQA: K/V are read once
per group, and the group is padded to 16 rows so the scores are a tensor-core dot). It writes a
normalised partial output and its log-sum-exp to fp32 scratch. The chunks of a (request, head) are then
merged through their log-sum-exps, in one of two ways:
- two launches: stage 2, one program per (request, head), after stage 1;
- one launch (`tickets` given): each stage-1 program, once its partial is stored, takes a ticket from a
  per-(request, KV head) counter (an atomic add, acq_rel at GPU scope, after a CTA barrier so every
  thread's stores are released); the program that draws the last ticket reads every chunk's partial
  (acquired by that add) and writes the output, then puts the counter back to 0, so the next launch (a
  later layer, step or CUDA-graph replay) finds it clean. Programs past a request's own split count
  take no part, so the count always matches.
With max_kv_splits == 1 (large batches already fill the GPU one program per request and KV head) each
program is alone: stage 1 writes the final output itself, merging a shared prefix's partials from the
cascade kernel's scratch columns where a request has them, and no counter is needed.

CUDA-graph safe: the grid depends only on the batch size and max_kv_splits (host ints fixed per
graph); sequence lengths and per-request split counts are read from device tensors.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._utils import dot_precision, next_pow2, num_sms, pdl_early_families, pdl_launch, pdl_prologue
from shared.knobs import knob

LOG2E = 1.4426950408889634


@triton.jit
def _tile_scores(q, k, mask_n, m_i, l_i, sm_scale_log2, DOT_PREC: tl.constexpr):
    """The online softmax's step for one tile of keys k [BLOCK_N, BLOCK_D] (mask_n the valid positions):
    (new running max, probabilities, rescale of the old sums, new running sum)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * sm_scale_log2
    s = tl.where(mask_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return m_new, p, alpha, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def pool_query(q, KB, KV_FP8: tl.constexpr):
    """q in the dtype attend_chunk computes in over pool KB: the pool's; over an FP8 pool a 16-bit query as float16
    (FP8 converts to it in one instruction, to bfloat16 through fp32, which costs the decode kernel ~30 registers;
    it holds every bfloat16 value of the range attention sees exactly, saturated at 65504), an fp32 one as it is."""
    if not KV_FP8:
        q = q.to(KB.dtype.element_ty)
    elif q.dtype != tl.float32:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    return q


@triton.jit
def attend_chunk(q, KB, VB, ROW, start, end, kv_base, stride_bs, offs_d, mask_d, sm_scale_log2,
                 ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
                 FIRST: tl.constexpr = False, k_first=None, v_first=None):
    """Online-softmax attention of query rows q [ROWS, BLOCK_D] (in the dtype attention computes in: the KV
    pool's, or for an FP8 pool the query's own, each k/v tile converted to it) over positions [start,
    end) of one req_to_token row (ROW points at it), KV head at kv_base: the normalised partial output
    [ROWS, BLOCK_D] fp32 and its log2-sum-exp [ROWS] (-inf, and an output of 0, for an empty chunk).
    FIRST: the first tile's k and v are already loaded (k_first, v_first: the decode kernel's, before its
    PDL wait). The decode and shared-prefix kernels' one inner loop."""
    m_i = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((ROWS,), dtype=tl.float32)
    acc = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)
    first = start
    if FIRST:
        if start < end:  # an empty chunk takes no tile (all of its scores would be -inf)
            m_i, p, alpha, l_i = _tile_scores(q, k_first.to(q.dtype), (start + tl.arange(0, BLOCK_N)) < end, m_i,
                                              l_i, sm_scale_log2, DOT_PREC)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v_first.to(q.dtype), input_precision=DOT_PREC)
        first = start + BLOCK_N
    for n0 in range(first, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = tl.load(ROW + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_off = kv_base + slots[:, None] * stride_bs + offs_d[None, :]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(KB + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        m_i, p, alpha, l_i = _tile_scores(q, k, mask_n, m_i, l_i, sm_scale_log2, DOT_PREC)
        v = tl.load(VB + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PREC)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    lse = tl.where(start >= end, float("-inf"), m_i + tl.log2(l_safe))
    return acc / l_safe[:, None], lse


@triton.jit
def merge_columns(acc, den, m, MID_O, MID_LSE, rows, mask_r, lo, hi, total, offs_d, mask_d, D,
                  CHUNK: tl.constexpr):
    """Folds the partials in scratch columns [lo, hi) of `rows` (request * Hq + head, mask_r) into a running
    log-sum-exp merge: acc [R, BLOCK_D] (weighted outputs), den [R] (their weights), m [R] (the largest
    log2-sum-exp so far, the weights' reference). The final output is acc / den. Columns are read CHUNK
    at a time, outputs and log-sum-exps at once (no load waits for another); a column with lse -inf (an
    empty chunk) weighs 0 and its output is not used: a prefix column no group wrote holds whatever was
    there. Loads bypass L1 (.cg): in the one-launch form other programs wrote them during this kernel."""
    offs_c = tl.arange(0, CHUNK)
    for c0 in range(lo, hi, CHUNK):
        cols = c0 + offs_c
        mask = mask_r[:, None] & (cols < hi)[None, :]
        idx = rows[:, None] * total + cols[None, :]
        lse = tl.load(MID_LSE + idx, mask=mask, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(MID_O + idx[:, :, None] * D + offs_d[None, None, :],
                    mask=mask[:, :, None] & mask_d[None, None, :], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, axis=1))
        ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # all empty so far (a padding request): weights 0
        w = tl.exp2(lse - ref[:, None])
        o = tl.where((lse > float("-inf"))[:, :, None], o, 0.0)
        scale = tl.exp2(m - ref)
        acc = acc * scale[:, None] + tl.sum(w[:, :, None] * o, axis=1)
        den = den * scale + tl.sum(w, axis=1)
        m = m_new
    return acc, den, m


@triton.jit
def merge_rows(MID_O, MID_LSE, rows, mask_r, n_splits, has_prefix, extra_from, total, offs_d, mask_d, D,
               BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr):
    """The attention output [BLOCK_R, BLOCK_D] fp32 of scratch `rows`: their columns [0, n_splits), and
    with has_prefix also a shared prefix's [extra_from, total) (the cascade kernel's). Zeros where every
    chunk was empty (a zero-length padding request)."""
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    den = tl.zeros((BLOCK_R,), dtype=tl.float32)
    m = tl.full((BLOCK_R,), float("-inf"), dtype=tl.float32)
    acc, den, m = merge_columns(acc, den, m, MID_O, MID_LSE, rows, mask_r, 0, n_splits, total, offs_d, mask_d, D,
                                CHUNK)
    if has_prefix:
        acc, den, m = merge_columns(acc, den, m, MID_O, MID_LSE, rows, mask_r, extra_from, total, total, offs_d,
                                    mask_d, D, CHUNK)
    return acc / tl.where(den > 0, den, 1.0)[:, None]


@triton.jit
def _chunk(SEQ_LENS, NUM_SPLITS, KV_START, REQ_IDX, b, split, stride_rt, BLOCK_N: tl.constexpr, HAS_START: tl.constexpr):
    """Request b's context length and split count, and chunk `split`'s positions [start, end) out of
    [kv_start, seq_len) (kv_start > 0: a shared prefix attended by the cascade kernel), with the offset of the
    request's req_to_token row. Chunks are whole BLOCK_N tiles so only the context's last tile needs masking."""
    seq_len = tl.load(SEQ_LENS + b)
    n_splits = tl.load(NUM_SPLITS + b)
    kv_start = 0
    if HAS_START:
        kv_start = tl.load(KV_START + b)
    split_len = tl.cdiv(tl.cdiv(seq_len - kv_start, n_splits), BLOCK_N) * BLOCK_N
    start = kv_start + split * split_len
    end = tl.minimum(start + split_len, seq_len)
    return seq_len, n_splits, kv_start, start, end, tl.load(REQ_IDX + b).to(tl.int64) * stride_rt


@triton.jit
def _decode_stage1(Q, KB, VB, REQ_TO_TOKEN, REQ_IDX, SEQ_LENS, NUM_SPLITS, MID_O, MID_LSE, KV_START, TICKETS, O,
                   sm_scale_log2, v_scale, stride_qb, stride_qh, stride_bs, stride_bh, stride_rt, stride_ob, stride_oh,
                   HQ, TOTAL, EXTRA_FROM, GROUP, D,
                   BLOCK_H: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                   CHUNK: tl.constexpr, DOT_PREC: tl.constexpr, HAS_START: tl.constexpr, FINAL: tl.constexpr,
                   TICKETED: tl.constexpr, PDL: tl.constexpr, KV_EARLY: tl.constexpr = False,
                   KV_FP8: tl.constexpr = False):
    """Without FINAL: partial output and log-sum-exp of one chunk into the scratch, for stage 2.
    FINAL: stage 1 writes the output itself, in O's dtype. A request's lone chunk (one split, no shared
    prefix) is final as it is (a lone split merges to itself exactly). Otherwise every chunk's partial
    goes to the scratch, and the last program of the (request, KV head) to finish merges them, a shared
    prefix's columns included: with TICKETED, the one whose increment of the pair's ticket counter
    returns n_splits - 1 (it then puts the counter back to 0 for the next launch); without, every
    request has one split (max_kv_splits == 1), so its program is the last.
    KV_FP8: an FP8 pool; k and v tiles are converted to q's dtype (float16 for a 16-bit q: pool_query), the
    keys' scale is in sm_scale_log2 and the values' (v_scale) multiplies each chunk's output (the merge is linear in
    them)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    n_kvh = tl.num_programs(1)
    split = tl.program_id(2)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    if KV_EARLY:
        # The step's inputs and the context's k, v up to the new token were written by kernels that finished
        # before the previous kernel's wait, so before this launch (the host checks that no kernel lets the
        # next launch before its wait): the chunk's first tile is loaded under the previous kernel's tail.
        seq_len, n_splits, kv_start, start, end, row = _chunk(SEQ_LENS, NUM_SPLITS, KV_START, REQ_IDX, b, split,
                                                              stride_rt, BLOCK_N, HAS_START)
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = (offs_n < end) & (split < n_splits)
        slots = tl.load(REQ_TO_TOKEN + row + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_off = kvh * stride_bh + slots[:, None] * stride_bs + offs_d[None, :]
        old = (mask_n & (offs_n < seq_len - 1))[:, None] & mask_d[None, :]
        k_first = tl.load(KB + kv_off, mask=old, other=0.0)
        v_first = tl.load(VB + kv_off, mask=old, other=0.0)
    pdl_prologue(PDL)
    if not KV_EARLY:
        seq_len, n_splits, kv_start, start, end, row = _chunk(SEQ_LENS, NUM_SPLITS, KV_START, REQ_IDX, b, split,
                                                              stride_rt, BLOCK_N, HAS_START)
    # Programs past the request's own split count (the grid is fixed per graph) take no part, not even
    # in the ticket count.
    if split < n_splits:
        offs_g = tl.arange(0, BLOCK_H)
        heads = kvh * GROUP + offs_g
        mask_h = offs_g < GROUP
        mask_hd = mask_h[:, None] & mask_d[None, :]
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_hd, other=0.0)
        q = pool_query(q, KB, KV_FP8)
        # A chunk past the end of a short context is empty: weight 0 in the merge (lse -inf, o 0).
        if KV_EARLY:  # the new token's k and v are the previous kernel's: read after the wait
            new = (mask_n & (offs_n == seq_len - 1))[:, None] & mask_d[None, :]
            k_first = tl.where(new, tl.load(KB + kv_off, mask=new, other=0.0), k_first)
            v_first = tl.where(new, tl.load(VB + kv_off, mask=new, other=0.0), v_first)
            o, lse = attend_chunk(q, KB, VB, REQ_TO_TOKEN + row, start, end, kvh * stride_bh, stride_bs, offs_d,
                                  mask_d, sm_scale_log2, BLOCK_H, BLOCK_D, BLOCK_N, DOT_PREC, True, k_first, v_first)
        else:
            o, lse = attend_chunk(q, KB, VB, REQ_TO_TOKEN + row, start, end, kvh * stride_bh, stride_bs, offs_d,
                                  mask_d, sm_scale_log2, BLOCK_H, BLOCK_D, BLOCK_N, DOT_PREC)
        if KV_FP8:
            o = o * v_scale
        if FINAL and not (TICKETED or HAS_START):
            lone = True  # max_kv_splits == 1, no shared prefix: every request is one chunk (no merge compiled)
        elif FINAL:
            lone = (n_splits == 1) & (kv_start == 0)
        else:
            lone = False
        if lone:
            # A zero-length (padding) request has o = 0: zeros, as the merge writes for it.
            tl.store(O + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                     o.to(O.dtype.element_ty), mask=mask_hd)
        else:
            idx = (b * HQ + heads) * TOTAL + split
            tl.store(MID_O + idx[:, None] * D + offs_d[None, :], o, mask=mask_hd)
            tl.store(MID_LSE + idx, lse, mask=mask_h)
            if FINAL:
                # Every thread's partial stored before one thread takes the ticket (acq_rel: a release of
                # them at GPU scope) and before the merge reads them back.
                tl.debug_barrier()
                last = True
                if TICKETED:
                    ticket = TICKETS + b * n_kvh + kvh
                    last = tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == n_splits - 1
                if last:
                    offs_r = tl.arange(0, BLOCK_G)
                    mask_r = offs_r < GROUP
                    rows = b * HQ + kvh * GROUP + offs_r
                    out = merge_rows(MID_O, MID_LSE, rows, mask_r, n_splits, kv_start > 0, EXTRA_FROM, TOTAL,
                                     offs_d, mask_d, D, BLOCK_G, BLOCK_D, CHUNK)
                    tl.store(O + b * stride_ob + (kvh * GROUP + offs_r)[:, None] * stride_oh + offs_d[None, :],
                             out.to(O.dtype.element_ty), mask=mask_r[:, None] & mask_d[None, :])
                    if TICKETED:
                        tl.store(ticket, 0)


@triton.jit
def _decode_stage2(MID_O, MID_LSE, NUM_SPLITS, KV_START, O, stride_ob, stride_oh, HQ, TOTAL, EXTRA_FROM, D,
                   BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, HAS_START: tl.constexpr, PDL: tl.constexpr):
    """One (request, head): columns [0, n_splits) merged, and for a request with a shared prefix
    (kv_start > 0) also [EXTRA_FROM, TOTAL), the prefix's partials."""
    pdl_prologue(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    has_prefix = False
    if HAS_START:
        has_prefix = tl.load(KV_START + b) > 0
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    rows = b * HQ + h + tl.arange(0, 1)
    out = merge_rows(MID_O, MID_LSE, rows, rows >= 0, tl.load(NUM_SPLITS + b), has_prefix, EXTRA_FROM, TOTAL,
                     offs_d, mask_d, D, 1, BLOCK_D, CHUNK)
    tl.store(O + b * stride_ob + h * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty), mask=mask_d[None, :])


def stage1_tile(block_d: int, kv_fp8: bool = False, max_kv_splits: int = 1) -> tuple[int, int, int]:
    """Stage 1's (BLOCK_N, warps, pipeline stages) for a head dim padded to block_d. Over an FP8 pool without
    software pipelining, and with two warps unless a request's context is cut into more than 16 chunks (small
    batches, whose last program merges them all): docs/kernels.md has the sweep."""
    block_n = 64 if block_d <= 128 else 32
    if kv_fp8:
        return block_n, (2 if max_kv_splits <= 16 else 4), 1
    return block_n, 4, 2


MIN_TOKENS_PER_SPLIT = knob("MIN_TOKENS_PER_SPLIT")
# Most chunks a request's context is cut into; the engine's --triton-attention-num-kv-splits default (32: fewer
# idle programs at short contexts). A test holds the two equal.
MAX_KV_SPLITS = 32
# Stage-1 programs per SM that plan_max_kv_splits aims for, read when a batch size's plan is made (graph capture).
PROGRAMS_PER_SM = knob("PROGRAMS_PER_SM")


def plan_max_kv_splits(batch_size: int, num_kv_heads: int, cap: int = MAX_KV_SPLITS) -> int:
    """Splits per request so that batch * kv_heads * splits fills the GPU ~PROGRAMS_PER_SM programs per SM.
    A host int of the batch size alone, hence fixed for a captured graph."""
    want = math.ceil(PROGRAMS_PER_SM * num_sms() / max(1, batch_size * num_kv_heads))
    return max(1, min(cap, next_pow2(want)))


def num_kv_splits_for(seq_lens: torch.Tensor, max_kv_splits: int,
                      min_tokens_per_split: int = MIN_TOKENS_PER_SPLIT) -> torch.Tensor:
    """Per-request split count on device (no sync): short contexts use fewer chunks."""
    n = torch.div(seq_lens + (min_tokens_per_split - 1), min_tokens_per_split, rounding_mode="floor")
    return n.clamp(1, max_kv_splits).to(torch.int32)


def merge_chunk(rows: int, block_d: int, columns: int) -> int:
    """Scratch columns a merge reads at once: all of them where the [rows, columns, block_d] fp32 tile
    stays within ~64 registers a thread (4 warps), else chunks of that size."""
    return max(1, min(next_pow2(columns), 8192 // (next_pow2(rows) * block_d)))


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, num_kv_splits: torch.Tensor,
                     max_kv_splits: int, scaling: float, out: torch.Tensor | None = None,
                     mid_o: torch.Tensor | None = None, mid_lse: torch.Tensor | None = None,
                     kv_start: torch.Tensor | None = None, tickets: torch.Tensor | None = None,
                     tile: tuple[int, int, int] | None = None,
                     k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """q: [B, Hq, D]; pool buffers [slots, Hkv, D]; returns [B, Hq, D] in q's dtype.
    mid_o [B, Hq, S, D] / mid_lse [B, Hq, S] fp32 scratch (S >= max_kv_splits) may be passed in so all
    layers reuse one allocation. With kv_start [B] int32, only positions [kv_start, seq_len) are read
    here, and for requests with kv_start > 0 columns [max_kv_splits, S) of the scratch, filled
    beforehand (triton_cascade.py), are merged in as well.
    One launch writes `out` where max_kv_splits == 1 (without kv_start no scratch is needed then), or
    where `tickets` is given: [>= B * Hkv] int32 counters, zero, and left zero (one buffer for every call
    of a process, allocated once: a captured graph keeps its address); the last program to finish
    each (request, KV head) merges its chunks. Otherwise a second launch (stage 2) merges them.
    tile (BLOCK_N, warps, stages) overrides stage 1's default (`stage1_tile`): for sweeps. k_scale, v_scale: an FP8 pool's (what its rows are multiplied by)."""
    B, HQ, D = q.shape
    HKV = k_buf.shape[1]
    assert HQ % HKV == 0 and q.stride(-1) == 1 and k_buf.is_contiguous() and v_buf.is_contiguous()
    group = HQ // HKV
    if out is None:
        out = torch.empty_like(q)
    ticketed = tickets is not None and max_kv_splits > 1
    final = max_kv_splits == 1 or ticketed
    assert kv_start is None or mid_lse is not None, "shared-prefix partials come in the scratch"
    assert not ticketed or (tickets.dtype == torch.int32 and tickets.numel() >= B * HKV)
    if mid_o is None and max_kv_splits > 1:
        mid_o = torch.empty((B, HQ, max_kv_splits, D), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((B, HQ, max_kv_splits), dtype=torch.float32, device=q.device)
    if B == 0:
        return out
    total_splits = mid_lse.shape[2] if mid_lse is not None else 1
    assert total_splits == max_kv_splits or kv_start is not None
    BLOCK_D = max(16, next_pow2(D))
    BLOCK_N, warps, stages = (tile if tile is not None
                              else stage1_tile(BLOCK_D, k_buf.element_size() == 1, max_kv_splits))
    widest = max(max_kv_splits, total_splits - max_kv_splits)  # a merge's own columns, or a shared prefix's
    # Query rows padded to 16, the smallest MMA (docs/kernels.md: 64 rows, Hopper's warpgroup MMA, was slower). The
    # first k/v tile loads before the PDL wait (KV_EARLY) unless some kernel family lets the next launch before its own
    # wait: then what a kernel before the previous one wrote may not be complete at launch.
    _decode_stage1[(B, HKV, max_kv_splits)](
        q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, num_kv_splits,
        mid_o if mid_o is not None else out, mid_lse if mid_lse is not None else out,
        kv_start if kv_start is not None else seq_lens, tickets if ticketed else seq_lens, out,
        scaling * k_scale * LOG2E, float(v_scale), q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1),
        req_to_token.stride(0), out.stride(0), out.stride(1), HQ, total_splits, max_kv_splits, group, D,
        BLOCK_H=max(16, next_pow2(group)), BLOCK_G=next_pow2(group), BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
        CHUNK=merge_chunk(group, BLOCK_D, widest), DOT_PREC=dot_precision(q.dtype), num_warps=warps,
        num_stages=stages, HAS_START=kv_start is not None, FINAL=final, TICKETED=ticketed,
        KV_EARLY=not pdl_early_families(), KV_FP8=k_buf.element_size() == 1, **pdl_launch(family="attention"))
    if final:
        return out
    _decode_stage2[(B, HQ)](
        mid_o, mid_lse, num_kv_splits, kv_start if kv_start is not None else seq_lens, out, out.stride(0),
        out.stride(1), HQ, total_splits, max_kv_splits, D, BLOCK_D=BLOCK_D, CHUNK=merge_chunk(1, BLOCK_D, widest),
        num_warps=4 if BLOCK_D >= 128 else 2, HAS_START=kv_start is not None, **pdl_launch(family="attention"))
    return out
