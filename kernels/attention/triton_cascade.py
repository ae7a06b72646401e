"""Shared-prefix (cascade) decode attention.

A decode batch often holds groups of requests whose KV begins with the same cached prefix (same pool
slots: one radix-tree node). Plain decode attention reads that prefix once per request; here it is read
once per group: one program takes a (group, KV head, prefix chunk) and attends the query rows of every
member and every query head of that KV head, as one [members x heads, D] block (a tensor-core dot),
against the chunk. Its normalised partial outputs and log-sum-exps go to extra columns of the decode
kernel's split scratch; the decode kernel then attends each request's own suffix [prefix_len, seq_len)
and merges everything per (request, head) through the log-sum-exp (triton_decode.decode_attention).

Not CUDA-graph safe (the grid depends on the batch's groups); the backend runs such batches eagerly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._utils import dot_precision, next_pow2, num_sms
from kernels.attention.triton_decode import LOG2E, decode_attention

MAX_ROWS = 128  # members x query heads of one program's block
MIN_TOKENS_PER_PREFIX_SPLIT = 128


@triton.jit
def _prefix_stage1(Q, KB, VB, REQ_TO_TOKEN, G_ROW, G_LEN, G_START, G_SIZE, MEMBERS, MID_O, MID_LSE,
                   sm_scale_log2, stride_qb, stride_qh, stride_bs, stride_bh, stride_rt,
                   HQ, TOTAL_SPLITS, FIRST_COL, N_SPLITS, GROUP, D,
                   BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr):
    gi = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    plen = tl.load(G_LEN + gi)
    size = tl.load(G_SIZE + gi)
    first = tl.load(G_START + gi)
    row = tl.load(G_ROW + gi).to(tl.int64) * stride_rt
    split_len = tl.cdiv(tl.cdiv(plen, N_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, plen)

    offs_m = tl.arange(0, BLOCK_M)
    r = offs_m // BLOCK_G
    g = offs_m % BLOCK_G
    mask_m = (r < size) & (g < GROUP)
    b = tl.load(MEMBERS + first + r, mask=mask_m, other=0).to(tl.int64)
    heads = kvh * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    mask_md = mask_m[:, None] & mask_d[None, :]
    q = tl.load(Q + b[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_md, other=0.0)
    q = q.to(KB.dtype.element_ty)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    kv_base = kvh * stride_bh
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = tl.load(REQ_TO_TOKEN + row + offs_n, mask=mask_n, other=0).to(tl.int64)
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
    empty = start >= end
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))
    idx = (b * HQ + heads) * TOTAL_SPLITS + FIRST_COL + split
    tl.store(MID_O + idx[:, None] * D + offs_d[None, :], acc / l_safe[:, None], mask=mask_md)
    tl.store(MID_LSE + idx, lse, mask=mask_m)


@dataclass
class CascadePlan:
    """Device metadata of one batch's prefix groups (a group larger than a block is cut into several,
    each still reading the prefix once)."""
    g_row: torch.Tensor  # [G] int64: req_to_token row holding the prefix's slots (any member's)
    g_len: torch.Tensor  # [G] int32: prefix length
    g_start: torch.Tensor  # [G] int32: offset of the group's members in `members`
    g_size: torch.Tensor  # [G] int32
    members: torch.Tensor  # [M] int32 batch indices
    kv_start: torch.Tensor  # [B] int32: where each request's own suffix starts (0 outside groups)
    num_groups: int
    prefix_splits: int
    block_r: int


def plan_cascade(groups: list[tuple[int, list[int]]], req_rows: list[int], batch_size: int, num_kv_heads: int,
                 gqa: int, device) -> CascadePlan | None:
    """groups: (prefix_len, member batch indices). None when no group remains."""
    block_g = next_pow2(gqa)
    block_r = min(MAX_ROWS // block_g, next_pow2(max((len(m) for _, m in groups), default=1)))
    block_r = max(block_r, -(-16 // block_g))  # a dot needs >= 16 rows
    rows, lens, starts, sizes, members = [], [], [], [], []
    kv_start = [0] * batch_size
    for plen, mem in groups:
        if plen <= 0 or len(mem) < 2:
            continue
        for i in range(0, len(mem), block_r):
            part = mem[i:i + block_r]
            rows.append(req_rows[part[0]])
            lens.append(plen)
            starts.append(len(members))
            sizes.append(len(part))
            members.extend(part)
        for b in mem:
            kv_start[b] = plen
    if not rows:
        return None
    G = len(rows)
    longest = max(lens)
    want = -(-4 * num_sms() // max(1, G * num_kv_heads))
    splits = max(1, min(next_pow2(want), -(-longest // MIN_TOKENS_PER_PREFIX_SPLIT), 64))

    def t(x, dtype):
        return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

    return CascadePlan(t(rows, torch.int64), t(lens, torch.int32), t(starts, torch.int32), t(sizes, torch.int32),
                       t(members, torch.int32), t(kv_start, torch.int32), G, splits, block_r)


def cascade_decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                             req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                             plan: CascadePlan, num_kv_splits: torch.Tensor, max_kv_splits: int,
                             scaling: float, mid_o: torch.Tensor | None = None,
                             mid_lse: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D]: each group's prefix attended once, merged with every request's own
    suffix. num_kv_splits: per-request splits of the suffix (at most max_kv_splits). Scratch, if
    given: [B, Hq, max_kv_splits + plan.prefix_splits(, D)] fp32."""
    B, HQ, D = q.shape
    HKV = k_buf.shape[1]
    group = HQ // HKV
    total = max_kv_splits + plan.prefix_splits
    if mid_o is None:
        mid_o = torch.empty((B, HQ, total, D), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((B, HQ, total), dtype=torch.float32, device=q.device)
    assert mid_lse.shape[2] == total
    mid_lse[:, :, max_kv_splits:].fill_(float("-inf"))  # requests outside every group
    BLOCK_D = max(16, next_pow2(D))
    BLOCK_N = 64 if BLOCK_D <= 128 else 32
    _prefix_stage1[(plan.num_groups, HKV, plan.prefix_splits)](
        q, k_buf, v_buf, req_to_token, plan.g_row, plan.g_len, plan.g_start, plan.g_size, plan.members,
        mid_o, mid_lse, scaling * LOG2E, q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1),
        req_to_token.stride(0), HQ, total, max_kv_splits, plan.prefix_splits, group, D,
        BLOCK_R=plan.block_r, BLOCK_G=next_pow2(group), BLOCK_M=plan.block_r * next_pow2(group),
        BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
        DOT_PREC=dot_precision(q.dtype), num_warps=4, num_stages=2)
    return decode_attention(q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, num_kv_splits,
                            max_kv_splits, scaling, mid_o=mid_o, mid_lse=mid_lse, kv_start=plan.kv_start)
