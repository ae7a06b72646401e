"""Shared-prefix (cascade) decode attention.

A decode batch often holds groups of requests whose KV begins with the same cached prefix (same pool
slots: one radix-tree node). Plain decode attention reads that prefix once per request; here it is read
once per group: one program takes a (group, KV head, prefix chunk) and attends the query rows of every
member and every query head of that KV head, as one [members x heads, D] block (a tensor-core dot),
against the chunk. Its normalised partial outputs and log-sum-exps go to extra columns of the decode
kernel's split scratch; the decode kernel then attends each request's own suffix [prefix_len, seq_len)
and merges everything per (request, head) through the log-sum-exp (triton_decode.decode_attention).

CUDA-graph safe with a fixed-capacity plan (`CascadeShape`): the grid is (group capacity, KV heads,
split capacity), host ints fixed per captured batch size; the groups themselves, their chunk counts
and the members live in device tensors the graph reads, and entries past the batch's groups do
nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._utils import dot_precision, next_pow2, num_sms
from kernels.attention.triton_decode import LOG2E, attend_chunk, decode_attention, pool_query
from shared.knobs import knob

MAX_ROWS = 64  # members x query heads of one program's block
MIN_TOKENS_PER_PREFIX_SPLIT = knob("MIN_TOKENS_PER_PREFIX_SPLIT")
MAX_PREFIX_SPLITS = knob("MAX_PREFIX_SPLITS")  # chunks a group prefix: more only multiply the partials' traffic


@triton.jit
def _prefix_stage1(Q, KB, VB, REQ_TO_TOKEN, G_ROW, G_LEN, G_START, G_SIZE, G_SPLITS, MEMBERS, MID_O, MID_LSE,
                   sm_scale_log2, v_scale, stride_qb, stride_qh, stride_bs, stride_bh, stride_rt,
                   HQ, TOTAL_SPLITS, FIRST_COL, GROUP, D,
                   BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, KV_FP8: tl.constexpr = False):
    gi = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # Entries past the batch's groups have size 0 and return at once. A chunk past the group's own
    # count stores an empty partial (lse -inf), so every prefix column of a member is written.
    size = tl.load(G_SIZE + gi)
    if size > 0:
        plen = tl.load(G_LEN + gi)
        first = tl.load(G_START + gi)
        n_splits = tl.maximum(tl.load(G_SPLITS + gi), 1)
        row = tl.load(G_ROW + gi).to(tl.int64) * stride_rt
        split_len = tl.cdiv(tl.cdiv(plen, n_splits), BLOCK_N) * BLOCK_N
        start = split * split_len
        end = tl.minimum(start + split_len, plen)
        end = tl.where(split < n_splits, end, start)

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
        q = pool_query(q, KB, KV_FP8)
        o, lse = attend_chunk(q, KB, VB, REQ_TO_TOKEN + row, start, end, kvh * stride_bh, stride_bs, offs_d, mask_d,
                              sm_scale_log2, BLOCK_M, BLOCK_D, BLOCK_N, DOT_PREC)
        if KV_FP8:
            o = o * v_scale
        idx = (b * HQ + heads) * TOTAL_SPLITS + FIRST_COL + split
        tl.store(MID_O + idx[:, None] * D + offs_d[None, :], o, mask=mask_md & (start < end))
        tl.store(MID_LSE + idx, lse, mask=mask_m)


@dataclass(frozen=True)
class CascadeShape:
    """Launch dimensions of a cascade plan. A captured graph fixes them per batch size (`for_graph`)."""
    max_groups: int  # group entries (grid axis 0)
    max_splits: int  # chunks per group prefix (grid axis 2; scratch columns past the suffix's)
    block_r: int  # members per entry (a larger group is cut into several entries)

    @staticmethod
    def block_rows(gqa: int) -> int:
        return max(MAX_ROWS // next_pow2(gqa), -(-16 // next_pow2(gqa)))  # a dot needs >= 16 rows

    @classmethod
    def for_graph(cls, batch_size: int, gqa: int, min_group: int) -> "CascadeShape":
        """Room for any batch whose groups have >= min_group members, cut into entries of block_r: a
        group of n takes ceil(n / block_r) entries, <= n / min_group when block_r >= min_group and
        <= n / block_r + 1 in any case."""
        block_r = cls.block_rows(gqa)
        entries = batch_size // min_group if block_r >= min_group else -(-batch_size // block_r) + batch_size // min_group
        return cls(max(1, entries), MAX_PREFIX_SPLITS, block_r)


@dataclass
class CascadeHostPlan:
    """A batch's prefix groups as host lists, cut into entries of at most block_r members."""
    rows: list[int]  # req_to_token row holding the prefix's slots (any member's)
    lens: list[int]  # prefix length
    starts: list[int]  # offset of the entry's members in `members`
    sizes: list[int]
    splits: list[int]  # chunks of the prefix
    members: list[int]  # batch indices
    kv_start: list[int]  # [B]: where each request's own suffix starts (0 outside groups)
    block_r: int

    @property
    def num_groups(self) -> int:
        return len(self.rows)

    def fits(self, shape: CascadeShape) -> bool:
        return (self.num_groups <= shape.max_groups and self.block_r == shape.block_r
                and max(self.splits) <= shape.max_splits)


@dataclass
class CascadePlan:
    """Device metadata of one batch's prefix groups, padded to its shape's capacities."""
    g_row: torch.Tensor  # [G] int64
    g_len: torch.Tensor  # [G] int32
    g_start: torch.Tensor  # [G] int32
    g_size: torch.Tensor  # [G] int32 (0: an unused entry)
    g_splits: torch.Tensor  # [G] int32
    members: torch.Tensor  # [>= M] int32 batch indices
    kv_start: torch.Tensor  # [B] int32
    shape: CascadeShape

    @property
    def prefix_splits(self) -> int:
        return self.shape.max_splits

    @classmethod
    def empty(cls, shape: CascadeShape, batch_size: int, device) -> "CascadePlan":
        """Static buffers a captured graph reads; `load` fills them before each replay."""
        G = shape.max_groups

        def z(n, dtype):
            return torch.zeros(n, dtype=dtype, device=device)
        return cls(z(G, torch.int64), z(G, torch.int32), z(G, torch.int32), z(G, torch.int32),
                   z(G, torch.int32), z(batch_size, torch.int32), z(batch_size, torch.int32), shape)

    def load(self, host: CascadeHostPlan, batch_size: int) -> None:
        """Copy a host plan into these buffers (non-blocking); entries past it become unused."""
        from kernels.h2d import to_device
        G, n = host.num_groups, len(host.members)
        dev = self.g_row.device
        pad = self.shape.max_groups - G
        self.g_row.copy_(to_device(host.rows + [0] * pad, torch.int64, dev), non_blocking=True)
        for buf, vals in ((self.g_len, host.lens), (self.g_start, host.starts), (self.g_size, host.sizes),
                          (self.g_splits, host.splits)):
            buf.copy_(to_device(vals + [0] * pad, torch.int32, dev), non_blocking=True)
        self.members[:n].copy_(to_device(host.members, torch.int32, dev), non_blocking=True)
        self.kv_start[:batch_size].copy_(to_device(host.kv_start, torch.int32, dev), non_blocking=True)
        if self.kv_start.shape[0] > batch_size:
            self.kv_start[batch_size:].zero_()


def plan_cascade_host(groups: list[tuple[int, list[int]]], req_rows: list[int], batch_size: int,
                      num_kv_heads: int, gqa: int, shape: CascadeShape | None = None) -> CascadeHostPlan | None:
    """groups: (prefix_len, member batch indices). None when no group remains. With `shape`, entries
    are cut to its block_r (the caller checks `fits`)."""
    if shape is not None:
        block_r = shape.block_r
    else:
        block_r = min(CascadeShape.block_rows(gqa), max(next_pow2(max((len(m) for _, m in groups), default=1)),
                                                        -(-16 // next_pow2(gqa))))
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
    # ~2 programs per SM over the whole batch (more chunks multiply the partials' traffic), and chunks
    # of at least MIN_TOKENS_PER_PREFIX_SPLIT.
    want = max(1, 2 * num_sms() // max(1, len(rows) * num_kv_heads))
    want = 1 << (want.bit_length() - 1)
    splits = [max(1, min(want, -(-p // MIN_TOKENS_PER_PREFIX_SPLIT), MAX_PREFIX_SPLITS)) for p in lens]
    return CascadeHostPlan(rows, lens, starts, sizes, splits, members, kv_start, block_r)


def plan_cascade(groups: list[tuple[int, list[int]]], req_rows: list[int], batch_size: int, num_kv_heads: int,
                 gqa: int, device) -> CascadePlan | None:
    """An eager batch's plan, sized to its own groups. None when no group remains."""
    host = plan_cascade_host(groups, req_rows, batch_size, num_kv_heads, gqa)
    if host is None:
        return None
    plan = CascadePlan.empty(CascadeShape(host.num_groups, max(host.splits), host.block_r), batch_size, device)
    plan.load(host, batch_size)
    return plan


def prefix_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                     plan: CascadePlan, first_col: int, scaling: float, mid_o: torch.Tensor,
                     mid_lse: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Each group's prefix attended once for all its members: partial outputs and log-sum-exps in scratch
    columns [first_col, first_col + plan.prefix_splits) of every member (other requests' columns are not
    written: decode_attention's merge skips them by kv_start). k_scale, v_scale: an FP8 pool's."""
    B, HQ, D = q.shape
    HKV = k_buf.shape[1]
    group = HQ // HKV
    total = mid_lse.shape[2]
    assert total == first_col + plan.prefix_splits
    BLOCK_D = max(16, next_pow2(D))
    BLOCK_N = 64 if BLOCK_D <= 128 else 32
    sh = plan.shape
    _prefix_stage1[(sh.max_groups, HKV, sh.max_splits)](
        q, k_buf, v_buf, req_to_token, plan.g_row, plan.g_len, plan.g_start, plan.g_size, plan.g_splits,
        plan.members, mid_o, mid_lse, scaling * k_scale * LOG2E, float(v_scale), q.stride(0), q.stride(1),
        k_buf.stride(0), k_buf.stride(1), req_to_token.stride(0), HQ, total, first_col, group, D,
        BLOCK_R=sh.block_r, BLOCK_G=next_pow2(group), BLOCK_M=sh.block_r * next_pow2(group),
        BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
        DOT_PREC=dot_precision(q.dtype), KV_FP8=k_buf.element_size() == 1, num_warps=4, num_stages=2)


def cascade_decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                             req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                             plan: CascadePlan, num_kv_splits: torch.Tensor, max_kv_splits: int,
                             scaling: float, mid_o: torch.Tensor | None = None,
                             mid_lse: torch.Tensor | None = None, out: torch.Tensor | None = None,
                             tickets: torch.Tensor | None = None, k_scale: float = 1.0,
                             v_scale: float = 1.0) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D]: each group's prefix attended once, merged with every request's own
    suffix. num_kv_splits: per-request splits of the suffix (at most max_kv_splits). Scratch, if
    given: [B, Hq, max_kv_splits + plan.prefix_splits(, D)] fp32. tickets: decode_attention's (the
    merge in the suffix kernel's launch). k_scale, v_scale: an FP8 pool's."""
    B, HQ, D = q.shape
    total = max_kv_splits + plan.prefix_splits
    if mid_o is None:
        mid_o = torch.empty((B, HQ, total, D), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((B, HQ, total), dtype=torch.float32, device=q.device)
    prefix_attention(q, k_buf, v_buf, req_to_token, plan, max_kv_splits, scaling, mid_o, mid_lse, k_scale, v_scale)
    return decode_attention(q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, num_kv_splits,
                            max_kv_splits, scaling, out=out, mid_o=mid_o, mid_lse=mid_lse, kv_start=plan.kv_start,
                            tickets=tickets, k_scale=k_scale, v_scale=v_scale)
