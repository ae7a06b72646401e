"""Rope and the KV store in the qkv GEMV's epilogue, for one row (decode at batch 1) or several (the tensor-core tile).

Unfused, a one-token layer runs qkv_proj, then a rope + KV-store kernel (kernels/rope.py) that reads q and k
back, rotates them and writes k and v into the pool: a short launch on the chain between two GEMVs. Fused,
the GEMV's programs own whole rotary pairs (rows d and d + rotary_dim/2 of one head; HF's rotate-half
layout), so each can rotate its own outputs and store them where they go: q's rows into the GEMV's output
(decode attention reads q there), k's and v's rows into the token's pool slot (and into the output too, so
that the result is the whole qkv row after rope).

Rounding is the unfused layer's: the GEMV's fp32 sums are rounded to the activation dtype first (the
unfused GEMV's output), rotated in fp32 and rounded again (the rope kernel's), then cast to the pool's dtype.
Full rotary only (rotary dim == head dim); the pool's buffers are contiguous [slots, Hkv, D].
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels.kv_store import to_pool


@dataclasses.dataclass(frozen=True)
class RopeStore:
    """One layer's rope + KV store for a decode pass's qkv GEMV: the output's first q_size rows are q, the next
    kv_size k, the last kv_size v. positions / loc: each token's position and pool slot ([M] device tensors, one a
    row of x, read by the kernel, so a CUDA graph may capture them); cos_sin_cache [max_pos, head_dim] fp32 (cos
    half, then sin half); k_buf / v_buf: the layer's pool buffers [slots, Hkv, head_dim], contiguous."""
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    k_buf: torch.Tensor
    v_buf: torch.Tensor
    loc: torch.Tensor
    q_size: int
    kv_size: int
    head_dim: int

    def __post_init__(self):
        d = self.head_dim
        assert d % 2 == 0 and self.cos_sin_cache.shape[1] == d and self.cos_sin_cache.stride(1) == 1, \
            "full rotary only: the cos/sin table is as wide as a head"
        assert self.q_size % d == 0 and self.kv_size % d == 0
        for buf in (self.k_buf, self.v_buf):
            assert buf.is_contiguous() and buf.shape[1] * buf.shape[2] == self.kv_size and buf.shape[2] == d
        assert self.k_buf.stride(0) == self.v_buf.stride(0)

    @property
    def size(self) -> int:
        """The GEMV's output rows: q, k and v."""
        return self.q_size + 2 * self.kv_size


@triton.jit
def rope_rows(pid, BLOCK: tl.constexpr, N, HALF: tl.constexpr):
    """The rows of program pid when each program owns BLOCK // 2 rotary pairs: row 2p of the block is pair p's
    first member (dim j < HALF of a head), row 2p + 1 its partner (dim j + HALF). A permutation of [0, N) for
    N a multiple of 2 * HALF; returns (rows, mask)."""
    i = tl.arange(0, BLOCK)
    g = pid * (BLOCK // 2) + i // 2
    return (g // HALF) * (2 * HALF) + g % HALF + (i % 2) * HALF, g < N // 2


@triton.jit
def _pairs(pid, N, QS, KVS, BLOCK: tl.constexpr, HALF: tl.constexpr):
    """Program pid's pairs: their dim j < HALF within the head and whether they rotate (q or k, in range)."""
    p = pid * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
    first = (p // HALF) * (2 * HALF) + p % HALF  # each pair's first row
    return p % HALF, (p < N // 2) & (first < QS + KVS)


@triton.jit
def rope_store_inputs(pid, N, POS, CS, stride_cs, LOC, QS, KVS, BLOCK: tl.constexpr, HALF: tl.constexpr):
    """The epilogue's inputs from earlier kernels (the token's position and slot: after the PDL wait), loaded
    ahead of the GEMV's loop so that no dependent round trip to memory sits in a program's tail: (cos, sin,
    slot)."""
    j, rot = _pairs(pid, N, QS, KVS, BLOCK, HALF)
    pos = tl.load(POS).to(tl.int64)
    cos = tl.load(CS + pos * stride_cs + j, mask=rot, other=1.0)
    sin = tl.load(CS + pos * stride_cs + HALF + j, mask=rot, other=0.0)
    return cos, sin, tl.load(LOC).to(tl.int64)


@triton.jit
def rope_store_epilogue(out, cos, sin, slot, pid, N, Y, KB, VB, stride_bs, QS, KVS, BLOCK: tl.constexpr,
                        HALF: tl.constexpr):
    """out: fp32 [BLOCK], the GEMV's results for rope_rows(pid, ...). Rounded to Y's dtype, q and k rotated at
    the token's position (cos, sin, slot: rope_store_inputs), every row written to Y, k's and v's also to the
    token's pool slot."""
    dt = Y.dtype.element_ty
    rows, mask = rope_rows(pid, BLOCK, N, HALF)
    _, rot = _pairs(pid, N, QS, KVS, BLOCK, HALF)
    a, b = tl.split(tl.reshape(out.to(dt).to(tl.float32), (BLOCK // 2, 2)))
    a2 = tl.where(rot, (a * cos - b * sin).to(dt), a.to(dt))
    b2 = tl.where(rot, (b * cos + a * sin).to(dt), b.to(dt))
    y = tl.reshape(tl.join(a2, b2), (BLOCK,))
    tl.store(Y + rows, y, mask=mask)
    is_k = (rows >= QS) & (rows < QS + KVS)
    # An FP8 pool's conversion (kv_store.to_pool) at unit scales: the epilogue runs only where a layer's are 1.0.
    tl.store(KB + slot * stride_bs + (rows - QS), to_pool(y, 1.0, KB.dtype.element_ty), mask=mask & is_k)
    is_v = rows >= QS + KVS
    tl.store(VB + slot * stride_bs + (rows - QS - KVS), to_pool(y, 1.0, VB.dtype.element_ty), mask=mask & is_v)


@triton.jit
def rope_store_rows(out, offs_m, mask_m, pid, N, POS, CS, stride_cs, LOC, Y, stride_ym, KB, VB, stride_bs, QS, KVS,
                    BLOCK: tl.constexpr, HALF: tl.constexpr):
    """rope_store_epilogue for several rows (the tensor-core tile): out fp32 [M_PAD, BLOCK], row m the token of
    POS[m] and pool slot LOC[m] (their inputs loaded here, in the program's tail)."""
    dt = Y.dtype.element_ty
    rows, mask = rope_rows(pid, BLOCK, N, HALF)
    j, rot = _pairs(pid, N, QS, KVS, BLOCK, HALF)
    pos = tl.load(POS + offs_m, mask=mask_m, other=0).to(tl.int64)
    at = mask_m[:, None] & rot[None, :]
    cos = tl.load(CS + pos[:, None] * stride_cs + j[None, :], mask=at, other=1.0)
    sin = tl.load(CS + pos[:, None] * stride_cs + HALF + j[None, :], mask=at, other=0.0)
    slot = tl.load(LOC + offs_m, mask=mask_m, other=0).to(tl.int64)
    a, b = tl.split(tl.reshape(out.to(dt).to(tl.float32), (out.shape[0], BLOCK // 2, 2)))
    a2 = tl.where(rot[None, :], (a * cos - b * sin).to(dt), a.to(dt))
    b2 = tl.where(rot[None, :], (b * cos + a * sin).to(dt), b.to(dt))
    y = tl.reshape(tl.join(a2, b2), (out.shape[0], BLOCK))
    valid = mask_m[:, None] & mask[None, :]
    tl.store(Y + offs_m[:, None] * stride_ym + rows[None, :], y, mask=valid)
    is_k = ((rows >= QS) & (rows < QS + KVS))[None, :]
    tl.store(KB + slot[:, None] * stride_bs + (rows - QS)[None, :], to_pool(y, 1.0, KB.dtype.element_ty),
             mask=valid & is_k)
    is_v = (rows >= QS + KVS)[None, :]
    tl.store(VB + slot[:, None] * stride_bs + (rows - QS - KVS)[None, :], to_pool(y, 1.0, VB.dtype.element_ty),
             mask=valid & is_v)


def rope_args(rope: RopeStore | None, x: torch.Tensor, epilogue_here: bool) -> dict:
    """The GEMV kernels' rope arguments (placeholders without rope). epilogue_here: this kernel holds the
    complete outputs (the GEMV without split K, or the split-K reduce)."""
    if rope is None:
        return dict(POS=x, CS=x, stride_cs=0, LOC=x, KB=x, VB=x, stride_bs=0, QS=0, KVS=0, ROPE=False, HALF=1)
    return dict(POS=rope.positions, CS=rope.cos_sin_cache, stride_cs=rope.cos_sin_cache.stride(0), LOC=rope.loc,
                KB=rope.k_buf, VB=rope.v_buf, stride_bs=rope.k_buf.stride(0), QS=rope.q_size, KVS=rope.kv_size,
                ROPE=epilogue_here, HALF=rope.head_dim // 2)
