"""Extend (prefill) attention over a paged cached prefix, for variable-length requests in one launch.

One program owns BLOCK_M query rows of one request: BLOCK_M new tokens of one query head, or, with
PACK > 1 query heads of a KV group packed into the rows, BLOCK_M // PACK tokens of PACK heads that read
the same K/V. It first streams the request's cached prefix through req_to_token (no mask: every prefix
token precedes every new token), then the request's own new tokens straight from the packed k/v tensors
with a causal mask. Online softmax in fp32 throughout.

Packing matters most for short extends (jump-forward's catch-up passes, a turn appended to a cached
chat): with a few new tokens per request, one head per program leaves most of a 128-row tile empty and
loads each request's prefix once per query head; packed, the group's heads fill the rows and the prefix
is loaded once per KV head (about 3x faster for many short extends; long prompts gain too, the causal diagonal
being finer: docs/kernels.md).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels._utils import dot_precision, next_pow2
from kernels.attention.triton_decode import LOG2E
from shared.knobs import knob

try:  # triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

# The new tokens' k and v are loaded by TMA (host tensor descriptors over [T, Hkv * D]) instead of pointer loads, on
# Hopper and later, in passes whose longest request adds at least TMA_MIN_TOKENS: below that the loop over whole key
# blocks barely runs, and each launch would encode two descriptors on the host for nothing.
TMA_MIN_TOKENS = knob("TMA_MIN_TOKENS")


@triton.jit
def _attend_block(acc, m_i, l_i, q, k, v, s_mask, sm_scale_log2, DOT_PREC: tl.constexpr, MASKED: tl.constexpr):
    """One online-softmax step over a key block: k, v [N, D], s_mask [M, N] (used if MASKED). Scores are
    scaled and shifted in one multiply-add; masked keys get a finite bias far below any score (no -inf,
    so no inf - inf guard: every row sees a visible key in its first block, the prefix's or its own
    diagonal's); P.V accumulates into the rescaled accumulator inside the MMA (faster than -inf masks and a
    separate scale and add: docs/kernels.md)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    if MASKED:
        s = s * sm_scale_log2 + tl.where(s_mask, 0.0, -1.0e6)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * sm_scale_log2)
        p = tl.exp2(s * sm_scale_log2 - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def _new_kv(KD, VD, k_ptrs, v_ptrs, stride_kt, stride_vt, row0, col, n0, mask, BLOCK_N: tl.constexpr,
            TMA: tl.constexpr):
    """Key block n0 of the request's own new tokens, k and v [BLOCK_N, D]: by TMA from row row0 + n0, column col of
    KD, VD, or by pointer loads (k_ptrs, v_ptrs at the request's first token) under mask."""
    if TMA:
        k = KD.load([row0 + n0, col])
        v = VD.load([row0 + n0, col])
    else:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = tl.load(k_ptrs + offs_n[:, None] * stride_kt, mask=mask, other=0.0)
        v = tl.load(v_ptrs + offs_n[:, None] * stride_vt, mask=mask, other=0.0)
    return k, v


@triton.jit
def _extend_kernel(Q, K, V, O, KB, VB, REQ_TO_TOKEN, REQ_IDX, PREFIX_LENS, EXTEND_LENS, START_LOC,
                   sm_scale_log2, k_scale, v_scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                   stride_ot, stride_oh, stride_bs, stride_bh, stride_rt, GROUP, D,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PACK: tl.constexpr,
                   DOT_PREC: tl.constexpr, KV_FP8: tl.constexpr = False, KD=None, VD=None, TMA: tl.constexpr = False):
    """KV_FP8: an FP8 pool. The prefix's k and v tiles are converted to q's dtype (v times v_scale first) and
    its scores take k_scale; the new tokens' k and v are read as computed, unrounded.
    TMA: the new tokens' k and v come through KD, VD (tensor descriptors over [T, Hkv * D], blocks [BLOCK_N, D];
    rows past the request are another request's or zeros, and the causal mask hides them)."""
    # Longest-running (last, most causal work) query blocks launch first to shorten the tail.
    mblk = tl.num_programs(0) - 1 - tl.program_id(0)
    hp = tl.program_id(1)  # query heads hp * PACK .. hp * PACK + PACK - 1, one KV head (PACK divides GROUP)
    b = tl.program_id(2)
    ext_len = tl.load(EXTEND_LENS + b)
    TOK_M: tl.constexpr = BLOCK_M // PACK
    m0 = mblk * TOK_M  # first new token of this block
    if m0 < ext_len:
        prefix_len = tl.load(PREFIX_LENS + b)
        tok0 = tl.load(START_LOC + b).to(tl.int64)
        kvh = (hp * PACK) // GROUP
        offs_r = tl.arange(0, BLOCK_M)
        offs_m = m0 + offs_r // PACK  # each row's token (row r: token r // PACK, head r % PACK)
        heads = hp * PACK + offs_r % PACK
        mask_m = offs_m < ext_len
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        q_off = (tok0 + offs_m[:, None]) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(Q + q_off, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        if KV_FP8:
            CDT: tl.constexpr = Q.dtype.element_ty  # what the dots take
        else:
            CDT: tl.constexpr = KB.dtype.element_ty
        q = q.to(CDT)
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)

        # Cached prefix, gathered through the request's slot row.
        row = tl.load(REQ_IDX + b).to(tl.int64) * stride_rt
        kv_base = kvh * stride_bh
        for n0 in range(0, prefix_len, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < prefix_len
            slots = tl.load(REQ_TO_TOKEN + row + offs_n, mask=mask_n, other=0).to(tl.int64)
            kv_off = kv_base + slots[:, None] * stride_bs + offs_d[None, :]
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(KB + kv_off, mask=kv_mask, other=0.0)
            v = tl.load(VB + kv_off, mask=kv_mask, other=0.0)
            if KV_FP8:
                acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k.to(CDT), (v.to(tl.float32) * v_scale).to(CDT),
                                              mask_n[None, :], sm_scale_log2 * k_scale, DOT_PREC, True)
            else:
                acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k, v, mask_n[None, :], sm_scale_log2, DOT_PREC,
                                              True)

        # The request's own new tokens in whole key blocks before this query block: visible to every row.
        k_ptrs = K + tok0 * stride_kt + kvh * stride_kh + offs_d[None, :]
        v_ptrs = V + tok0 * stride_vt + kvh * stride_vh + offs_d[None, :]
        n_full = (m0 // BLOCK_N) * BLOCK_N
        row0 = tok0.to(tl.int32)
        col = kvh * D
        for n0 in range(0, n_full, BLOCK_N):
            k, v = _new_kv(KD, VD, k_ptrs, v_ptrs, stride_kt, stride_vt, row0, col, n0, mask_d[None, :], BLOCK_N, TMA)
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k.to(CDT), v.to(CDT), mask_m[:, None], sm_scale_log2,
                                          DOT_PREC, False)
        # The rest up to the block's last token: causal mask.
        n_end = tl.minimum(ext_len, m0 + TOK_M)
        for n0 in range(n_full, n_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < n_end
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k, v = _new_kv(KD, VD, k_ptrs, v_ptrs, stride_kt, stride_vt, row0, col, n0, kv_mask, BLOCK_N, TMA)
            causal = (offs_n[None, :] <= offs_m[:, None]) & mask_n[None, :]
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k.to(CDT), v.to(CDT), causal, sm_scale_log2, DOT_PREC,
                                          True)

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_off = (tok0 + offs_m[:, None]) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(O + o_off, out.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def extend_block_sizes(head_dim: int, dtype: torch.dtype, rows: int | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) that fit shared memory for this head size. rows: with
    heads packed, a request's query rows (new tokens x packed heads); None: one head per program."""
    if not torch.cuda.is_available():
        return 32, 32, 4, 1
    if rows is None:
        if head_dim <= 64:
            return 128, 64, 4, 3
        if head_dim <= 128:
            # Three stages: the sweep's best at 8k causal tokens (docs/kernels.md).
            return (128, 64, 8, 3) if dtype != torch.float32 else (64, 32, 4, 2)
        return 64, 32, 4, 2
    if head_dim > 128 or dtype == torch.float32:
        return 64, 32, 4, 2
    # The best, or within 9% of it, of the tilings swept from many short extends to one 8k causal prompt; fewer
    # rows than a tile shrink it.
    return (64 if rows >= 64 else max(16, next_pow2(rows))), 64, 4, 3


def extend_pack(num_heads: int, num_kv_heads: int) -> int:
    """Query heads per program: the largest power of two dividing the group size (a tile's rows are a
    power of two), at most 16."""
    group = num_heads // num_kv_heads
    return min(group & -group, 16)


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor,
                     v_buf: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     extend_prefix_lens: torch.Tensor, extend_seq_lens: torch.Tensor,
                     extend_start_loc: torch.Tensor, max_extend_len: int, scaling: float,
                     out: torch.Tensor | None = None,
                     config: tuple[int, int, int, int] | None = None, pack: int | None = None,
                     k_scale: float = 1.0, v_scale: float = 1.0, tma: bool | None = None) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] of the new tokens (packed like q); prefixes come from the pool.
    max_extend_len: a host upper bound on any request's new-token count (sizes the grid).
    config: (BLOCK_M, BLOCK_N, num_warps, num_stages) override. pack: query heads per program (a divisor
    of the group size Hq / Hkv dividing BLOCK_M); None: extend_pack's. k_scale, v_scale: an FP8 pool's (its
    prefix rows are multiplied by them; the new tokens' k, v are read as passed). tma: the new tokens' k and v by
    TMA where tma_applies says (None: for passes of at least TMA_MIN_TOKENS a request)."""
    T, HQ, D = q.shape
    HKV = k.shape[1]
    assert HQ % HKV == 0 and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_buf.is_contiguous() and v_buf.is_contiguous()
    if out is None:
        out = torch.empty_like(q)
    B = extend_seq_lens.shape[0]
    if T == 0 or B == 0:
        return out
    BLOCK_D = max(16, next_pow2(D))
    if pack is None:
        pack = extend_pack(HQ, HKV)
    BLOCK_M, BLOCK_N, num_warps, num_stages = config or extend_block_sizes(
        BLOCK_D, q.dtype, max_extend_len * pack if pack > 1 else None)
    assert (HQ // HKV) % pack == 0 and BLOCK_M % pack == 0, (HQ, HKV, pack, BLOCK_M)
    grid = (triton.cdiv(max_extend_len, BLOCK_M // pack), HQ // pack, B)
    if tma is None:
        tma = max_extend_len >= TMA_MIN_TOKENS
    tma = tma and tma_applies(k, v, BLOCK_D)
    descs = {}
    if tma:
        descs = {"KD": _kv_descriptor(k, BLOCK_N), "VD": _kv_descriptor(v, BLOCK_N), "TMA": True}
    _extend_kernel[grid](
        q, k, v, out, k_buf, v_buf, req_to_token, req_pool_indices, extend_prefix_lens, extend_seq_lens,
        extend_start_loc, scaling * LOG2E, float(k_scale), float(v_scale), q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1), k_buf.stride(0), k_buf.stride(1),
        req_to_token.stride(0), HQ // HKV, D,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, PACK=pack, DOT_PREC=dot_precision(q.dtype),
        KV_FP8=k_buf.element_size() == 1, num_warps=num_warps, num_stages=num_stages, **descs)
    return out


def tma_applies(k: torch.Tensor, v: torch.Tensor, block_d: int) -> bool:
    """Whether the new tokens' k and v can be read by TMA: a descriptor library, a Hopper-or-later GPU (or the
    interpreter), each token's heads side by side with a power-of-two head size (a block is one head's D), 16-byte
    aligned rows and bases."""
    if TensorDescriptor is None:
        return False
    for t in (k, v):
        if t.dim() != 3 or t.stride(2) != 1 or t.stride(1) != t.shape[2] or t.shape[2] != block_d:
            return False
        if (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    if k.is_cuda:
        return torch.cuda.get_device_capability(k.device)[0] >= 9
    return os.environ.get("TRITON_INTERPRET") == "1"


def _kv_descriptor(t: torch.Tensor, block_n: int):
    """[T, H, D] with heads side by side as a [T, H * D] tensor descriptor of [block_n, D] blocks."""
    T, H, D = t.shape
    return TensorDescriptor(t, [T, H * D], [t.stride(0), 1], [block_n, D])
