"""Every Triton kernel against its torch reference, plus the Triton attention backend end to end.

On CPU the kernels run under TRITON_INTERPRET=1 in a subprocess (the flag must be set before the kernel
modules are imported, which another test module may already have done in this process); that
subprocess runs this file as a script and reports one result per check. On CUDA the same checks run
in process in bf16 with wider tolerances.
"""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _tol(dtype):
    return dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def _head_dims(device):
    return (16, 32, 24) if device.type == "cpu" else (64, 128, 16)


def _rand(*shape, dtype, device):
    return torch.randn(*shape, dtype=torch.float32, device=device).to(dtype)


def check_rms_norm(device, dtype):
    from kernels.norm import rms_norm
    from kernels.reference import rms_norm_ref
    for T, H in [(1, 16), (7, 48), (5, 130)] + ([(3, 4096)] if device.type == "cuda" else []):
        x, w, r = (_rand(T, H, dtype=dtype, device=device) for _ in range(3))
        w = w[0]
        torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), **_tol(dtype))
        r_in = r.clone()
        y, r_out = rms_norm(x, w, 1e-5, r_in)
        y_ref, r_ref = rms_norm_ref(x, w, 1e-5, r)
        torch.testing.assert_close(y, y_ref, **_tol(dtype))
        torch.testing.assert_close(r_out, r_ref, **_tol(dtype))
        assert r_out.data_ptr() == r_in.data_ptr(), "residual must be updated in place"


def check_embed_rms_norm(device, dtype):
    """The embedding lookup and the first norm of a pass in one launch: the looked-up rows bit for bit, the norm
    the same bits as rms_norm on them, the partial sums cleared; no rows, only the clearing."""
    from kernels.norm import embed_rms_norm, rms_norm
    table = _rand(50, 130, dtype=dtype, device=device)
    w = _rand(130, dtype=dtype, device=device)
    for ids in ([7], [0, 49, 7, 7]):
        ids = torch.tensor(ids, device=device)
        sums = torch.ones(40, dtype=torch.float64, device=device)
        y, e = embed_rms_norm(ids, table, w, 1e-5, zero=sums)
        assert torch.equal(e, table[ids]) and torch.equal(y, rms_norm(table[ids], w, 1e-5))
        assert not sums.any()
    sums = torch.ones(3, dtype=torch.float64, device=device)
    y, e = embed_rms_norm(torch.zeros(0, dtype=torch.int64, device=device), table, w, 1e-5, zero=sums)
    assert y.shape == (0, 130) and not sums.any()


def check_rope(device, dtype):
    from kernels.reference import rope_cos_sin_cache, rope_ref
    from kernels.rope import apply_rope
    for T, hq, hkv, d, rot in [(7, 4, 2, 16, 16), (3, 4, 1, 32, 16), (1, 2, 2, 16, 16)]:
        inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32, device=device) / rot))
        cache = rope_cos_sin_cache(inv_freq, 300)
        qkv = _rand(T, (hq + 2 * hkv) * d, dtype=dtype, device=device)
        q, k = qkv[:, :hq * d], qkv[:, hq * d:(hq + hkv) * d]  # strided views, as a fused qkv gives
        pos = torch.randint(0, 300, (T,), device=device)
        q_ref, k_ref = rope_ref(q.clone(), k.clone(), pos, cache, d)
        v_before = qkv[:, (hq + hkv) * d:].clone()
        apply_rope(q, k, pos, cache, d)
        torch.testing.assert_close(q, q_ref, **_tol(dtype))
        torch.testing.assert_close(k, k_ref, **_tol(dtype))
        assert torch.equal(qkv[:, (hq + hkv) * d:], v_before), "rope must not touch v"
        # [T, H, D] views work too.
        q3 = _rand(T, hq, d, dtype=dtype, device=device)
        k3 = _rand(T, hkv, d, dtype=dtype, device=device)
        q3_ref, k3_ref = rope_ref(q3.clone(), k3.clone(), pos, cache, d)
        apply_rope(q3, k3, pos, cache, d)
        torch.testing.assert_close(q3, q3_ref, **_tol(dtype))
        torch.testing.assert_close(k3, k3_ref, **_tol(dtype))


def check_decode_inputs(device, dtype):
    """One staged block unpacked as the reference does: input tokens gathered from the request rows,
    positions, rows, slots and lengths, the slot-table entry written (padding rows: row 0, length 1,
    slot 0)."""
    from kernels.decode_inputs import unpack_decode_inputs
    from kernels.reference import decode_inputs_ref
    g = torch.Generator().manual_seed(3)
    for B, pad in [(1, 0), (5, 3), (130, 6)]:
        rows = torch.randperm(200, generator=g)[:B] + 1
        seq = torch.randint(1, 40, (B,), generator=g)
        loc = torch.randint(1, 10_000, (B,), generator=g)
        zeros = torch.zeros(pad, dtype=torch.int64)
        staged = torch.stack([torch.cat([rows, zeros]), torch.cat([seq, zeros + 1]), torch.cat([loc, zeros]),
                              torch.cat([loc + 7, zeros])], dim=1).contiguous().to(device)
        token_buf = torch.randint(0, 32_000, (201,), generator=g).to(device)
        table = torch.randint(0, 10_000, (201, 48), generator=g, dtype=torch.int32).to(device)
        table[0] = 0
        n = B + pad
        outs = [torch.full((n,), -1, dtype=dt, device=device) for dt in (torch.int64,) * 4 + (torch.int32,) * 2]
        want = decode_inputs_ref(staged, token_buf, table)
        unpack_decode_inputs(staged, token_buf, table, *outs)
        for got, ref in zip(outs + [table], want):
            assert got.dtype == ref.dtype and torch.equal(got, ref), f"decode inputs differ (B={B}, pad={pad})"


def check_rope_store_kv(device, dtype):
    """The fused rope + KV store equals rope then store_kv bit for bit (q, k in place and the pool),
    and the references; partial rotary (rotary dim < head dim) stores the unrotated tail too."""
    from kernels.kv_store import store_kv
    from kernels.reference import rope_cos_sin_cache, rope_ref, store_kv_ref
    from kernels.rope import apply_rope, apply_rope_and_store_kv
    for T, hq, hkv, d, rot in [(1, 4, 2, 16, 16), (7, 4, 2, 16, 16), (3, 8, 1, 32, 16), (5, 6, 3, 24, 24)]:
        inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32, device=device) / rot))
        cache = rope_cos_sin_cache(inv_freq, 300)
        qkv = _rand(T, (hq + 2 * hkv) * d, dtype=dtype, device=device)
        pos = torch.randint(0, 300, (T,), device=device)
        loc = torch.randperm(40, device=device)[:T]
        worlds = []
        for fused in (True, False):
            x = qkv.clone()
            q = x[:, :hq * d]
            k = x[:, hq * d:(hq + hkv) * d].view(T, hkv, d)
            v = x[:, (hq + hkv) * d:].view(T, hkv, d)
            kb, vb = (torch.zeros(40, hkv, d, dtype=dtype, device=device) for _ in range(2))
            if fused:
                apply_rope_and_store_kv(q, k, v, pos, cache, d, kb, vb, loc)
            else:
                apply_rope(q, k, pos, cache, d)
                store_kv(kb, vb, loc, k, v)
            worlds.append((x, kb, vb))
        for a, b in zip(*worlds):
            assert torch.equal(a, b), f"fused rope+store differs from rope then store_kv (T={T} d={d} rot={rot})"
        # out=True: the same q, k, v bits as new contiguous [T, H, D] tensors, the inputs untouched, the
        # same pool writes.
        x = qkv.clone()
        q, k, v = x[:, :hq * d], x[:, hq * d:(hq + hkv) * d], x[:, (hq + hkv) * d:]
        kb, vb = (torch.zeros(40, hkv, d, dtype=dtype, device=device) for _ in range(2))
        qo, ko, vo = apply_rope_and_store_kv(q, k, v, pos, cache, d, kb, vb, loc, out=True)
        assert torch.equal(x, qkv), "out=True must leave q, k, v as they were"
        rotated = worlds[0][0]
        for got, want, h in [(qo, rotated[:, :hq * d], hq), (ko, rotated[:, hq * d:(hq + hkv) * d], hkv),
                             (vo, rotated[:, (hq + hkv) * d:], hkv)]:
            assert got.is_contiguous() and got.shape == (T, h, d)
            assert torch.equal(got, want.reshape(T, h, d)), f"out=True differs (T={T} d={d} rot={rot})"
        assert torch.equal(kb, worlds[0][1]) and torch.equal(vb, worlds[0][2])
        x, kb, vb = worlds[0]
        q_ref, k_ref = rope_ref(qkv[:, :hq * d], qkv[:, hq * d:(hq + hkv) * d], pos, cache, d)
        kb_ref, vb_ref = torch.zeros_like(kb), torch.zeros_like(vb)
        store_kv_ref(kb_ref, vb_ref, loc, k_ref.view(T, hkv, d), qkv[:, (hq + hkv) * d:].view(T, hkv, d))
        torch.testing.assert_close(x[:, :hq * d], q_ref, **_tol(dtype))
        torch.testing.assert_close(kb, kb_ref, **_tol(dtype))
        assert torch.equal(vb, vb_ref)


def check_silu_and_mul(device, dtype):
    from kernels.activation import silu_and_mul
    from kernels.reference import silu_and_mul_ref
    for T, I in [(1, 16), (7, 130), (2, 1100)]:
        x = _rand(T, 2 * I, dtype=dtype, device=device)
        torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), **_tol(dtype))


def check_store_kv(device, dtype):
    from kernels.kv_store import store_kv
    from kernels.reference import store_kv_ref
    for T, h, d in [(1, 2, 16), (9, 3, 24), (33, 8, 32)]:
        kv = _rand(T, 2, h, d, dtype=dtype, device=device)
        k, v = kv[:, 0], kv[:, 1]  # non-contiguous views
        loc = torch.randperm(64, device=device)[:T]
        bufs = [torch.zeros(64, h, d, dtype=dtype, device=device) for _ in range(4)]
        store_kv(bufs[0], bufs[1], loc, k, v)
        store_kv_ref(bufs[2], bufs[3], loc, k, v)
        assert torch.equal(bufs[0], bufs[2]) and torch.equal(bufs[1], bufs[3])


def check_store_kv_fp8(device, dtype):
    """FP8 pools (e4m3 and e5m2, with and without per-layer scales): store_kv and the fused rope + KV store
    write what kernels.reference.to_pool_ref does (x / scale saturated and rounded to nearest even; compared
    as values, -0 == 0), including values past the format's range and in its subnormals."""
    from kernels.kv_store import store_kv
    from kernels.reference import rope_cos_sin_cache, rope_ref, to_pool_ref
    from kernels.rope import apply_rope_and_store_kv
    T, hq, hkv, d = 24, 4, 2, 16
    mag = torch.logspace(-6, 3.5, T, device=device)[:, None, None]  # subnormal .. past e4m3's 448
    for pool in (torch.float8_e4m3fn, torch.float8_e5m2):
        for ks, vs in [(1.0, 1.0), (0.37, 2.5)]:
            kv = _rand(T, 2, hkv, d, dtype=torch.float32, device=device)
            k, v = (kv[:, 0] * mag).to(dtype), (kv[:, 1] * mag).to(dtype)
            loc = torch.randperm(64, device=device)[:T]
            kb, vb = (torch.zeros(64, hkv, d, dtype=pool, device=device) for _ in range(2))
            store_kv(kb, vb, loc, k, v, ks, vs)
            assert torch.equal(kb[loc].float(), to_pool_ref(k, ks, pool).float()), f"{pool} k scale {ks}"
            assert torch.equal(vb[loc].float(), to_pool_ref(v, vs, pool).float()), f"{pool} v scale {vs}"
            assert not kb.float().isnan().any() and kb.float().abs().max() <= torch.finfo(pool).max
            # The fused rope + store: the rotated k (as rope_ref rounds it) converted the same way.
            inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
            cache = rope_cos_sin_cache(inv_freq, 300)
            q = _rand(T, hq * d, dtype=dtype, device=device)
            pos = torch.randint(0, 300, (T,), device=device)
            kb2, vb2 = (torch.zeros(64, hkv, d, dtype=pool, device=device) for _ in range(2))
            _, k_rot = rope_ref(q, k.reshape(T, -1).clone(), pos, cache, d)
            apply_rope_and_store_kv(q.clone(), k.reshape(T, -1).clone(), v, pos, cache, d, kb2, vb2, loc, k_scale=ks,
                                    v_scale=vs)
            ref_k = to_pool_ref(k_rot.view(T, hkv, d), ks, pool).float()
            # rope in the kernel and in rope_ref may differ in k's last bit, which can move an FP8 rounding by a step
            torch.testing.assert_close(kb2[loc].float(), ref_k, rtol=0.13, atol=1e-6)
            assert (kb2[loc].float() == ref_k).float().mean() > 0.95, f"{pool} rope+store"
            assert torch.equal(vb2[loc].float(), to_pool_ref(v, vs, pool).float())


def check_attention_fp8_pool(device, dtype):
    """Decode (one and several splits, one- and two-launch merges), shared-prefix decode and extend attention over
    FP8 pools with per-layer scales equal the references that read the same pool (its rows times the scales);
    extend reads the new tokens' own k and v, unrounded."""
    from kernels.attention.triton_cascade import cascade_decode_attention, plan_cascade
    from kernels.attention.triton_decode import decode_attention, num_kv_splits_for
    from kernels.attention.triton_extend import extend_attention
    from kernels.reference import (cascade_decode_attention_ref, decode_attention_ref, extend_attention_ref,
                                   to_pool_ref)
    d, hq, hkv = _head_dims(device)[1], 8, 2
    ks, vs = 0.5, 1.7
    for pool in (torch.float8_e4m3fn, torch.float8_e5m2):
        lens = [1, 9, 70, 130]
        k_buf, v_buf, r2t, req_idx, seq = _paged_setup(device, torch.float32, hkv, d, [n - 1 for n in lens],
                                                       [1] * len(lens))
        kb, vb = to_pool_ref(k_buf, ks, pool), to_pool_ref(v_buf, vs, pool)
        seq_lens = torch.tensor(seq, dtype=torch.int32, device=device)
        q = _rand(len(lens), hq, d, dtype=dtype, device=device)
        ref = decode_attention_ref(q, kb, vb, r2t, req_idx, seq_lens, d ** -0.5, ks, vs)
        tickets = torch.zeros(len(lens) * hkv, dtype=torch.int32, device=device)
        # 32 chunks a request at most: stage 1 on four warps (two up to 16: triton_decode.stage1_tile).
        for max_splits, tk in [(1, None), (4, None), (4, tickets), (32, None), (32, tickets)]:
            splits = num_kv_splits_for(seq_lens, max_splits, 16)
            out = decode_attention(q, kb, vb, r2t, req_idx, seq_lens, splits, max_splits, d ** -0.5, tickets=tk,
                                   k_scale=ks, v_scale=vs)
            torch.testing.assert_close(out, ref, **_tol(dtype), msg=lambda m: f"{pool} splits={max_splits}: {m}")
        # Without the head-dim mask (triton_decode.EVEN_D_MASK: D fills the tile here), the same bits.
        import kernels.attention.triton_decode as td
        splits = num_kv_splits_for(seq_lens, 4, 16)
        masked = decode_attention(q, kb, vb, r2t, req_idx, seq_lens, splits, 4, d ** -0.5, k_scale=ks, v_scale=vs)
        td.EVEN_D_MASK = True
        try:
            even = decode_attention(q, kb, vb, r2t, req_idx, seq_lens, splits, 4, d ** -0.5, k_scale=ks, v_scale=vs)
        finally:
            td.EVEN_D_MASK = False
        assert torch.equal(masked, even)
        # Query tiles padded to 64 rows (triton_decode.STAGE1_MIN_ROWS: Hopper's warpgroup MMA), the reference's output.
        td.STAGE1_MIN_ROWS = 64
        try:
            wide = decode_attention(q, kb, vb, r2t, req_idx, seq_lens, splits, 4, d ** -0.5, k_scale=ks, v_scale=vs)
        finally:
            td.STAGE1_MIN_ROWS = 16
        torch.testing.assert_close(wide, ref, **_tol(dtype), msg=lambda m: f"{pool} 64 query rows: {m}")
        # A 16-bit query meets the FP8 tiles in float16 (pool_query); on the CPU too.
        qb = q.to(torch.bfloat16)
        refb = decode_attention_ref(qb, kb, vb, r2t, req_idx, seq_lens, d ** -0.5, ks, vs)
        out = decode_attention(qb, kb, vb, r2t, req_idx, seq_lens, num_kv_splits_for(seq_lens, 4, 16), 4, d ** -0.5,
                               tickets=tickets, k_scale=ks, v_scale=vs)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, refb, **_tol(torch.bfloat16), msg=lambda m: f"{pool} bf16 query: {m}")
        # Shared prefix: requests 1 and 3 share their first 9 slots.
        r2t[4, :9] = r2t[2, :9]
        groups = [(9, [1, 3])]
        ref = cascade_decode_attention_ref(q, kb, vb, r2t, req_idx, seq_lens, groups, d ** -0.5, ks, vs)
        torch.testing.assert_close(ref, decode_attention_ref(q, kb, vb, r2t, req_idx, seq_lens, d ** -0.5, ks, vs),
                                   **_tol(dtype))
        plan = plan_cascade(groups, [1, 2, 3, 4], len(lens), hkv, hq // hkv, device)
        splits = num_kv_splits_for(seq_lens - plan.kv_start, 4, 16)
        out = cascade_decode_attention(q, kb, vb, r2t, req_idx, seq_lens, plan, splits, 4, d ** -0.5,
                                       tickets=tickets, k_scale=ks, v_scale=vs)
        torch.testing.assert_close(out, ref, **_tol(dtype), msg=lambda m: f"{pool} cascade: {m}")
        # Extend over a cached prefix: the new tokens' k, v passed in the activation dtype.
        prefix, ext = [0, 40, 9], [7, 17, 5]
        k_buf, v_buf, r2t, req_idx, _ = _paged_setup(device, torch.float32, hkv, d, prefix, ext)
        kb, vb = to_pool_ref(k_buf, ks, pool), to_pool_ref(v_buf, vs, pool)
        T = sum(ext)
        slots = torch.cat([r2t[i + 1, p:p + e] for i, (p, e) in enumerate(zip(prefix, ext))]).long()
        k, v = k_buf[slots].to(dtype), v_buf[slots].to(dtype)
        q = _rand(T, hq, d, dtype=dtype, device=device)
        i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
        starts = i32([sum(ext[:i]) for i in range(len(ext))])
        ref = extend_attention_ref(q, kb, vb, r2t, req_idx, prefix, ext, d ** -0.5, ks, vs, k, v)
        out = extend_attention(q, k, v, kb, vb, r2t, req_idx, i32(prefix), i32(ext), starts, max(ext), d ** -0.5,
                               k_scale=ks, v_scale=vs)
        torch.testing.assert_close(out, ref, **_tol(dtype), msg=lambda m: f"{pool} extend: {m}")
        # The scales matter: without them the output differs.
        off = extend_attention(q, k, v, kb, vb, r2t, req_idx, i32(prefix), i32(ext), starts, max(ext), d ** -0.5)
        assert not torch.allclose(off, ref, **_tol(dtype))


def check_gemv(device, dtype):
    from kernels.gemv import GemvConfig, gemv
    from kernels.reference import gemv_ref
    shapes = [(64, 48), (200, 37), (96, 130)]
    if device.type == "cuda":
        shapes += [(4096, 6144), (14336, 4096)]
    # One row takes the row kernel (row_kernel=False: the general one): x read through w-shaped pointers or as
    # one broadcast row (block_k below or above 16 bytes x 32 lanes x warps), unrolled folds that do not divide
    # the tiles, narrow accumulators, two tiles before the PDL wait, ragged K.
    configs = [None, GemvConfig(16, 32, 1, 4), GemvConfig(8, 32, 4, 4), GemvConfig(32, 64, 2, 4),
               GemvConfig(16, 32, 1, 4, pre_tiles=2), GemvConfig(8, 16, 3, 2, pre_tiles=2),
               GemvConfig(2, 64, 1, 1, pre_tiles=2, narrow=True), GemvConfig(4, 16, 1, 1, fold=3),
               GemvConfig(8, 16, 2, 2, fold=2, narrow=True), GemvConfig(4, 256, 1, 2, narrow=True),
               GemvConfig(16, 32, 1, 4, row_kernel=False)]
    for K, N in shapes:
        w = _rand(N, K, dtype=dtype, device=device)
        for M in (1, 2, 3, 4):
            x = _rand(M, K, dtype=dtype, device=device)
            for cfg in configs:
                if device.type == "cuda":  # the PDL launch (first tile loaded before the wait): same bits
                    assert torch.equal(gemv(x, w, config=cfg, pdl=True), gemv(x, w, config=cfg, pdl=False))
                torch.testing.assert_close(gemv(x, w, config=cfg), gemv_ref(x, w), **_tol(dtype),
                                           msg=lambda m: f"K={K} N={N} M={M} {cfg}: {m}")


def check_gemv_rows(device, dtype):
    """Several rows of unquantized weights on the tensor-core tile (kernels.ops.GEMV_MAX_M past one row), at the tile
    shapes `bench.probe bf16_small_m` sweeps, with ragged N and split K; kernels.gemv.BF16_ROWS_TILES overrides the
    default tile of the shapes it lists, and only at several rows."""
    import kernels.gemv as g
    from kernels.reference import gemv_ref
    shapes = [(256, 130)] + ([(4096, 6144), (14336, 4096)] if device.type == "cuda" else [])
    for K, N in shapes:
        w = _rand(N, K, dtype=dtype, device=device)
        for M in (5, 16):
            x = _rand(M, K, dtype=dtype, device=device)
            for cfg in (g.GemvConfig(64, 128, 1, 8), g.GemvConfig(128, 128, 2, 8), g.GemvConfig(16, 256, 1, 4)):
                torch.testing.assert_close(g.gemv(x, w, config=cfg), gemv_ref(x, w), **_tol(dtype),
                                           msg=lambda m: f"K={K} N={N} M={M} {cfg}: {m}")
    saved = dict(g.BF16_ROWS_TILES)
    try:
        g.BF16_ROWS_TILES[130, 256] = (32, 64, 4)
        cfg = g.default_config(8, 130, 256)
        assert (cfg.block_n, cfg.block_k, cfg.num_warps) == (32, 64, 4)
        assert g.default_config(1, 130, 256) != cfg and g.default_config(8, 130, 256, 1) != cfg
        w, x = _rand(130, 256, dtype=dtype, device=device), _rand(8, 256, dtype=dtype, device=device)
        torch.testing.assert_close(g.gemv(x, w), gemv_ref(x, w), **_tol(dtype))
    finally:
        g.BF16_ROWS_TILES.clear()
        g.BF16_ROWS_TILES.update(saved)


class _Launches:
    """Stands in for a Triton kernel (kernel[grid](...)): each launch's grid appended to `launched`, then launched."""

    def __init__(self, kernel, launched: list):
        self.kernel, self.launched = kernel, launched

    def __getitem__(self, grid):
        self.launched.append(grid)
        return self.kernel[grid]


def check_gemv_two_rows(device, dtype):
    """kernels.gemv.TWO_ROW_KERNEL: two rows on the one-row kernel (each weight tile against both) give each row's
    one-row GEMV bit for bit: the row tiles' variants (x through w-shaped pointers or one broadcast row, folds, narrow
    accumulators, two tiles before the PDL wait), split K, ragged K, the gated input, FP8 weights where the row kernel
    takes them, and a strided x and output; without the knob, or with an epilogue, two rows take the tensor-core tile."""
    import kernels.gemv as kg
    from kernels.gemv import GemvConfig, gemv
    from shared.models.quantization import quantize_per_channel
    shapes = [(64, 48), (200, 37)] + ([(4096, 6144), (14336, 4096)] if device.type == "cuda" else [])
    configs = [None, GemvConfig(16, 32, 1, 4), GemvConfig(2, 64, 1, 1, pre_tiles=2, narrow=True),
               GemvConfig(4, 16, 1, 1, fold=3), GemvConfig(8, 16, 2, 2, fold=2, narrow=True),
               GemvConfig(4, 256, 1, 2, narrow=True), GemvConfig(8, 32, 2, 2, pre_tiles=2, f16_math=True)]
    saved, saved_fp8, launched = kg.TWO_ROW_KERNEL, kg.TWO_ROW_KERNEL_FP8, []
    real = kg._gemv_row_kernel
    try:
        kg._gemv_row_kernel = _Launches(real, launched)
        for K, N in shapes:
            w = _rand(N, K, dtype=dtype, device=device)
            q, s = (t.to(device) for t in quantize_per_channel(w.float().cpu()))
            xs = _rand(2, K + 8, dtype=dtype, device=device)[:, :K]  # rows K + 8 apart
            h = _rand(2, 2 * K, dtype=dtype, device=device)
            for cfg in configs:
                for wt, scale in ((w, None), (q, s)):
                    if scale is not None and cfg is not None and not cfg.f16_math:
                        continue
                    for fp8_rows in ((False, True) if scale is not None and cfg is None else (False,)):
                        kg.TWO_ROW_KERNEL, kg.TWO_ROW_KERNEL_FP8 = True, fp8_rows
                        launched.clear()
                        out = torch.full((2, N + 5), 7.0, dtype=dtype, device=device)[:, :N]
                        y = gemv(xs, wt, out=out, config=cfg, scale=scale)
                        yg = gemv(h, wt, config=cfg, scale=scale, silu_mul=True)
                        on_row_kernel = bool(launched)
                        # the reference: one row at the tile two rows took (two_row_config's where none is given: on
                        # Llama's shapes its K tile is not the one-row default's, so the sums' order differs)
                        ref = cfg or kg.two_row_config(N, K, wt.element_size())
                        assert on_row_kernel == (not kg.on_tensor_cores(2, wt, scale) or cfg is not None)
                        kg.TWO_ROW_KERNEL, kg.TWO_ROW_KERNEL_FP8 = False, False
                        # 16-bit weights always reach the row kernel; FP8 ones where their config is a row
                        # kernel's (their default one-row config is the general kernel's, so two rows stay on the
                        # tensor-core tile, unless TWO_ROW_KERNEL_FP8 gives them row tiles)
                        assert on_row_kernel == (scale is None or cfg is not None or fp8_rows), (K, N, cfg, launched)
                        for r in range(2 if on_row_kernel else 0):
                            msg = f"K={K} N={N} {cfg} fp8={scale is not None} row {r}"
                            assert torch.equal(y[r:r + 1], gemv(xs[r:r + 1], wt, config=ref, scale=scale)), msg
                            one = gemv(h[r:r + 1], wt, config=ref, scale=scale, silu_mul=True)
                            if scale is not None and device.type == "cuda":  # FP8's f16 products of the activation
                                # computed in the load: the compiled two-row and one-row kernels may round silu(g)·u
                                # apart before its f16 cast (1 bf16 ulp at Llama's qkv shape, tile (2, 512, 2), H100
                                # 2026-12-06); the interpreter computes both alike, and is held to the bits
                                torch.testing.assert_close(yg[r:r + 1], one, rtol=2 ** -6, atol=0.125, msg=msg)
                            else:
                                assert torch.equal(yg[r:r + 1], one), msg
        launched.clear()
        gemv(_rand(2, 64, dtype=dtype, device=device), _rand(48, 64, dtype=dtype, device=device))
        assert not launched  # the knob off: the tensor-core tile
        # kernels.ops' gated down projection at two rows on the row kernel: the activation in the load (no
        # silu_and_mul launch), the bits of each row's one-row GEMV
        import kernels.ops as ops
        on_gpu, max_m, sm = ops._on_gpu, ops.GEMV_MAX_M, ops.silu_and_mul
        acts = []
        ops._on_gpu, ops.GEMV_MAX_M = (lambda t: True), 16
        ops.silu_and_mul = lambda t: acts.append(t.shape[0]) or sm(t)
        try:
            bf = torch.bfloat16  # kernels.ops' GEMV takes bf16 weights and activations
            w, h = _rand(40, 64, dtype=bf, device=device), _rand(2, 128, dtype=bf, device=device)
            q, sq = (t.to(device) for t in quantize_per_channel(w.float().cpu()))
            # bf16 weights, then FP8 ones (on the row kernel only with TWO_ROW_KERNEL_FP8)
            for wt, scale, fp8_rows in ((w, None, False), (q, sq, False), (q, sq, True)):
                for two in (True, False):
                    kg.TWO_ROW_KERNEL, kg.TWO_ROW_KERNEL_FP8 = two, fp8_rows
                    acts.clear()
                    y = ops.silu_mul_linear(h, wt, None, scale)
                    fused = two and (scale is None or fp8_rows)
                    ref = kg.two_row_config(40, 64, wt.element_size())
                    kg.TWO_ROW_KERNEL, kg.TWO_ROW_KERNEL_FP8 = False, False
                    assert acts == ([] if fused else [2]), (two, scale is not None, fp8_rows, acts)
                    if fused:
                        assert all(torch.equal(y[r:r + 1], gemv(h[r:r + 1], wt, config=ref, scale=scale, silu_mul=True))
                                   for r in range(2))
        finally:
            ops._on_gpu, ops.GEMV_MAX_M, ops.silu_and_mul = on_gpu, max_m, sm
        # kernels.gemv.TWO_ROW_TILES (a sweep's picks) override two_row_config's rule for the shapes they list
        kg.TWO_ROW_TILES[48, 64] = (4, 32, 2)
        cfg = kg.two_row_config(48, 64)
        assert (cfg.block_n, cfg.block_k, cfg.num_warps, cfg.narrow, cfg.row_kernel) == (4, 32, 2, True, True)
        assert kg.two_row_config(40, 64) != cfg
        kg.TWO_ROW_KERNEL = True
        w, x = _rand(48, 64, dtype=dtype, device=device), _rand(2, 64, dtype=dtype, device=device)
        y = gemv(x, w)
        kg.TWO_ROW_KERNEL = False
        assert all(torch.equal(y[r:r + 1], gemv(x[r:r + 1], w, config=cfg)) for r in range(2))
    finally:
        kg.TWO_ROW_KERNEL, kg.TWO_ROW_KERNEL_FP8 = saved, saved_fp8
        kg.TWO_ROW_TILES.pop((48, 64), None)
        kg._gemv_row_kernel = real


def check_gemv_row_kernel(device, dtype):
    """The one-row kernel and the general kernel compute the same fp32 sums in other orders: equal to well
    inside the output's rounding, at every tile shape (x in w's layout either way) and with the gated input."""
    from kernels.gemv import GemvConfig, gemv
    for K, N in [(96, 40), (130, 24)] + ([(4096, 6144), (14336, 4096)] if device.type == "cuda" else []):
        w = _rand(N, K, dtype=dtype, device=device)
        x = _rand(1, 2 * K, dtype=dtype, device=device)
        for silu_mul in (False, True):
            xin = x if silu_mul else x[:, :K]
            for cfg in (GemvConfig(2, 64, 1, 1, pre_tiles=2), GemvConfig(8, 32, 2, 2, narrow=True, fold=2),
                        GemvConfig(4, 128, 1, 1, narrow=True)):
                row = gemv(xin, w, config=cfg, silu_mul=silu_mul)
                general = gemv(xin, w, config=GemvConfig(cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps,
                                                         row_kernel=False), silu_mul=silu_mul)
                torch.testing.assert_close(row, general, **_tol(dtype), msg=lambda m: f"{K}x{N} {cfg}: {m}")


def check_gemv_silu_mul(device, dtype):
    """The down projection with the gated activation folded into its input load equals silu_and_mul
    then the GEMV bit for bit (every config: split-K, odd K, several rows)."""
    from kernels.activation import silu_and_mul
    from kernels.gemv import GemvConfig, gemv
    from kernels.reference import gemv_ref, silu_and_mul_ref
    shapes = [(64, 48), (200, 37), (96, 130)]
    if device.type == "cuda":
        shapes += [(14336, 4096)]
    for K, N in shapes:
        w = _rand(N, K, dtype=dtype, device=device)
        for M in (1, 3):
            h = _rand(M, 2 * K, dtype=dtype, device=device)
            for cfg in [None, GemvConfig(16, 32, 1, 4), GemvConfig(8, 32, 4, 4), GemvConfig(8, 16, 2, 2, pre_tiles=2)]:
                y = gemv(h, w, config=cfg, silu_mul=True)
                assert torch.equal(y, gemv(silu_and_mul(h), w, config=cfg)), f"K={K} N={N} M={M} {cfg}"
                torch.testing.assert_close(y, gemv_ref(silu_and_mul_ref(h), w), **_tol(dtype))


def _qkv_heads(device):
    """A qkv projection's heads for the rope epilogue checks (Llama-8B's on CUDA, a small set on the CPU):
    (q heads, kv heads, head dim, K, q size, kv size, N, the rotary cos/sin cache)."""
    from kernels.reference import rope_cos_sin_cache
    hq, hkv, d, K = (4, 2, 16, 96) if device.type == "cpu" else (32, 8, 128, 4096)
    inv_freq = 1.0 / (500000 ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    return hq, hkv, d, K, hq * d, hkv * d, (hq + 2 * hkv) * d, rope_cos_sin_cache(inv_freq, 4096)


def check_gemv_two_row_epilogues(device, dtype):
    """kernels.gemv.TWO_ROW_EPILOGUES: two rows on the one-row kernel with the rope + KV-store epilogue (each row at its
    own position and slot) or the gating one give each row's one-row GEMV with that epilogue, bit for bit: y and the
    pool, bf16 weights and FP8 ones (TWO_ROW_KERNEL_FP8: FP8 rows at their own row tiles by default), tiles that would
    split K; one launch of the row kernel, nothing on the tensor-core tile; nothing written outside the rows' slots.
    Without the knob the epilogues keep two rows on the tensor-core tile."""
    import dataclasses

    import kernels.gemv as kg
    from kernels.gemv import GemvConfig, gemv
    from kernels.rope_store import RopeStore
    from shared.models.quantization import quantize_per_channel
    gen = torch.Generator().manual_seed(29)
    hq, hkv, d, K, qs, kvs, N, cache = _qkv_heads(device)
    wq = _rand(N, K, dtype=dtype, device=device) * 0.1
    wg = _rand(2 * (40 if device.type == "cpu" else 14336), K, dtype=dtype, device=device) * 0.1
    quant = [tuple(t.to(device) for t in quantize_per_channel(w.float().cpu())) for w in (wq, wg)]
    x = _rand(2, K, dtype=dtype, device=device)
    pos = torch.randint(0, 4096, (2,), generator=gen).to(device)
    loc = (torch.randperm(40, generator=gen)[:2] + 1).to(device)
    configs = [None, GemvConfig(4, 32, 2, 2, narrow=True), GemvConfig(2, 64, 1, 1, pre_tiles=2, fold=2)]
    rows, general = [], []
    saved = kg.TWO_ROW_KERNEL, kg.TWO_ROW_KERNEL_FP8, kg.TWO_ROW_EPILOGUES
    real_row, real_general = kg._gemv_row_kernel, kg._gemv_kernel
    pools = lambda: tuple(torch.zeros(41, hkv, d, dtype=dtype, device=device) for _ in range(2))  # noqa: E731
    try:
        kg._gemv_row_kernel, kg._gemv_kernel = _Launches(real_row, rows), _Launches(real_general, general)
        for fp8 in (False, True):
            (w_rope, s_rope), (w_gate, s_gate) = quant if fp8 else ((wq, None), (wg, None))
            for cfg in configs:
                if fp8 and cfg is not None:
                    cfg = dataclasses.replace(cfg, f16_math=True)
                kg.TWO_ROW_KERNEL, kg.TWO_ROW_KERNEL_FP8, kg.TWO_ROW_EPILOGUES = True, True, True
                rows.clear(), general.clear()
                fused = pools()
                y = gemv(x, w_rope, config=cfg, scale=s_rope, rope=RopeStore(pos, cache, *fused, loc, qs, kvs, d))
                yg = gemv(x, w_gate, config=cfg, scale=s_gate, gated_out=True)
                msg = f"fp8={fp8} {cfg}"
                assert len(rows) == 2 and not general, (msg, rows, general)
                # each row alone at the tile two rows took (unsplit, as both epilogues run)
                one = lambda w: dataclasses.replace(cfg or kg.two_row_config(*w.shape, w.element_size()),  # noqa
                                                    split_k=1)
                ref_rope, ref_gate = one(w_rope), one(w_gate)
                kg.TWO_ROW_KERNEL = kg.TWO_ROW_KERNEL_FP8 = kg.TWO_ROW_EPILOGUES = False
                for r in range(2):
                    alone = pools()
                    yr = gemv(x[r:r + 1], w_rope, config=ref_rope, scale=s_rope,
                              rope=RopeStore(pos[r:r + 1], cache, *alone, loc[r:r + 1], qs, kvs, d))
                    assert torch.equal(y[r:r + 1], yr), f"{msg} rope row {r}"
                    assert all(torch.equal(a[loc[r]], b[loc[r]]) for a, b in zip(fused, alone)), f"{msg} pool row {r}"
                    assert torch.equal(yg[r:r + 1], gemv(x[r:r + 1], w_gate, config=ref_gate, scale=s_gate,
                                                         gated_out=True)), f"{msg} gated row {r}"
                others = torch.ones(41, dtype=torch.bool, device=device)
                others[loc] = False
                assert not any(buf[others].any() for buf in fused), f"{msg}: written outside the rows' slots"
        # without TWO_ROW_EPILOGUES both epilogues take two rows to the tensor-core tile
        kg.TWO_ROW_KERNEL, kg.TWO_ROW_KERNEL_FP8 = True, True
        rows.clear(), general.clear()
        gemv(x, wq, rope=RopeStore(pos, cache, *pools(), loc, qs, kvs, d))
        gemv(x, wg, gated_out=True)
        assert not rows and len(general) == 2, (rows, general)
    finally:
        kg.TWO_ROW_KERNEL, kg.TWO_ROW_KERNEL_FP8, kg.TWO_ROW_EPILOGUES = saved
        kg._gemv_row_kernel, kg._gemv_kernel = real_row, real_general


def check_gemv_gated_out(device, dtype):
    """gated_out: the gate | up projection's GEMV returning silu(gate) * up from its epilogue gives the bits of
    silu_and_mul of the plain GEMV's output at the same tile unsplit (each row's sums in the same order, rounded
    the same): the row kernel and the general one, one-row tiles widened to a pair, ragged I, FP8 weights with
    per-row scales, a split norm's consumer; several rows on the tensor-core tile. Refused where the epilogue cannot
    run."""
    import dataclasses

    from kernels.activation import silu_and_mul
    from kernels.gemv import GemvConfig, default_config, gemv
    from kernels.residual_norm import NORM_SLOTS, ResidualNorm
    from shared.models.quantization import quantize_per_channel
    shapes = [(96, 2 * 20), (130, 2 * 37)] + ([(4096, 2 * 14336)] if device.type == "cuda" else [])
    cfgs = [None, GemvConfig(2, 32, 1, 1), GemvConfig(1, 32, 1, 1), GemvConfig(4, 64, 1, 2, pre_tiles=2, fold=2),
            GemvConfig(8, 32, 2, 2, row_kernel=False), GemvConfig(4, 32, 2, 2, pre_tiles=2, f16_math=True)]
    for K, N in shapes:
        w = _rand(N, K, dtype=dtype, device=device) * 0.1
        x = _rand(1, K, dtype=dtype, device=device)
        r = _rand(1, K, dtype=dtype, device=device)
        sums = torch.zeros(NORM_SLOTS, dtype=torch.float64, device=device)
        sums[0] = (r.double() ** 2).sum()
        norm = ResidualNorm(r, _rand(K, dtype=dtype, device=device), sums, 1e-5)
        for fp8 in (False, True):
            wq, scale = (w, None)
            if fp8:
                wq, scale = (t.to(device) for t in quantize_per_channel(w.float().cpu()))
            for cfg in cfgs:
                base = cfg or default_config(1, N, K, wq.element_size())
                unsplit = dataclasses.replace(base, block_n=max(2, base.block_n), split_k=1)
                for norm_in in (None, norm):
                    # Written into a row with sentinels past I: a store beyond the gate rows would show there.
                    buf = torch.full((1, N // 2 + 8), 7.0, dtype=dtype, device=device)
                    y = gemv(x, wq, out=buf[:, :N // 2], config=cfg, scale=scale, norm_in=norm_in, gated_out=True)
                    ref = silu_and_mul(gemv(x, wq, config=unsplit, scale=scale, norm_in=norm_in))
                    assert y.shape == (1, N // 2) and bool((buf[:, N // 2:] == 7.0).all())
                    assert torch.equal(y, ref), (K, N, fp8, cfg, norm_in is not None, (y - ref).abs().max())
        # Several rows (the tensor-core tile, kernels.ops.gated_linear's rows): silu_and_mul of the plain GEMV's
        # output, to its rounding (the MMA's sums for a gate row sit in another column there).
        for fp8 in (False, True):
            wq, scale = (w, None)
            if fp8:
                wq, scale = (t.to(device) for t in quantize_per_channel(w.float().cpu()))
            for M in (3, 16):
                xm = _rand(M, K, dtype=dtype, device=device)
                buf = torch.full((M, N // 2 + 8), 7.0, dtype=dtype, device=device)
                for cfg in (None, GemvConfig(16, 32, 1, 4)):
                    y = gemv(xm, wq, out=buf[:, :N // 2], config=cfg, scale=scale, gated_out=True)
                    ref = silu_and_mul(gemv(xm, wq, config=cfg, scale=scale))
                    assert y.shape == (M, N // 2) and bool((buf[:, N // 2:] == 7.0).all())
                    torch.testing.assert_close(y, ref, **_tol(dtype), msg=lambda m: f"{K, N, fp8, M, cfg}: {m}")
    w = _rand(40, 96, dtype=dtype, device=device)
    for x, extra in ((_rand(1, 192, dtype=dtype, device=device), {"silu_mul": True}),):  # a gated input
        try:
            gemv(x, w, gated_out=True, **extra)
        except AssertionError as e:
            assert "gated_out" in str(e)
        else:
            raise AssertionError(f"gated_out accepted {tuple(x.shape)} {extra}")


def check_gemv_fp8_codes(device, dtype):
    """The FP8 GEMV reads every e4m3 code exactly (subnormals, both zeros, +-448; NaN left out), at every
    byte position of a 16-byte load: a one-hot x returns the weight column times its scale bit for bit."""
    from kernels.gemv import GemvConfig, gemv
    from kernels.reference import FP8_DTYPE
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)
    N, K = len(codes), 64
    s = (torch.rand(N) + 0.5).to(device)
    for col in (0, 1, 2, 3, 15, 37, 62):
        w = torch.zeros(N, K, dtype=torch.uint8)
        w[:, col] = codes
        w8 = w.view(FP8_DTYPE).to(device)
        x = torch.zeros(1, K, device=device, dtype=dtype)  # bf16 on a GPU: the row kernel's 8-byte weight loads
        x[0, col] = 1.0
        for cfg in (None, GemvConfig(8, 32, 1, 2), GemvConfig(8, 16, 2, 1), GemvConfig(8, 32, 1, 2, f16_math=True),
                    GemvConfig(8, 32, 1, 2, row_kernel=False), GemvConfig(8, 16, 2, 1, row_kernel=False)):
            y = gemv(x, w8, scale=s, config=cfg)[0]
            assert torch.equal(y, (w8.float()[:, col] * s).to(dtype)), f"column {col} {cfg}"


def check_gemv_fp8_f16_math(device, dtype):
    """FP8 rows multiplied in f16 (the default at one row) agree with fp32 math and with the dequantized
    weights to well under the output's own rounding, small and large activations alike (x is scaled by
    2^-8 so |w| * |x| stays in f16's range), with split K, ragged K and the gated down projection."""
    from kernels.activation import silu_and_mul
    from kernels.gemv import GemvConfig, default_config, gemv
    from kernels.reference import fp8_linear_ref
    from shared.models.quantization import quantize_per_channel
    import kernels.gemv as kg
    gen = torch.Generator().manual_seed(1)
    assert default_config(1, 4096, 4096, 1).f16_math and not default_config(1, 4096, 4096, 2).f16_math
    assert not default_config(1, 4096, 4096, 1).row_kernel  # FP8 rows: the general kernel until measured
    kg.FP8_ROW_KERNEL = True
    try:
        assert default_config(1, 4096, 4096, 1).row_kernel and default_config(1, 4096, 4096, 1).f16_math
    finally:
        kg.FP8_ROW_KERNEL = False
    for K, N in [(256, 48), (200, 40), (1024, 24)]:
        q, s = quantize_per_channel(torch.randn(N, K, generator=gen) * 0.02)
        q, s = q.to(device), s.to(device)
        for mag in (0.01, 1.0, 300.0):
            x = (torch.randn(1, K, generator=gen) * mag).to(device=device, dtype=dtype)
            ref = fp8_linear_ref(x.float(), q, s)
            for bn, bk, split in [(8, 64, 1), (16, 32, 3), (8, 256, 2)]:
                for row in (True, False):  # the one-row kernel and the general one
                    f16 = gemv(x, q, scale=s, config=GemvConfig(bn, bk, split, 2, f16_math=True, row_kernel=row)).float()
                    f32 = gemv(x, q, scale=s, config=GemvConfig(bn, bk, split, 2, row_kernel=row)).float()
                    # Within the output's rounding (bf16's half-ulp is 2^-9 of a value) plus f16 math's own error.
                    tol = (2e-3 if dtype == torch.float32 else 6e-3) * float(ref.abs().max())
                    assert float((f16 - ref).abs().max()) < tol, (K, N, mag, bn, bk, split, row)
                    assert float((f16 - f32).abs().max()) < tol, (K, N, mag, bn, bk, split, row)
        h = _rand(1, 2 * K, dtype=dtype, device=device)
        y = gemv(h, q, scale=s, silu_mul=True)
        torch.testing.assert_close(y, gemv(silu_and_mul(h), q, scale=s), rtol=0, atol=0)
        row = GemvConfig(8, 64, 1, 2, f16_math=True, pre_tiles=2, fold=2)
        torch.testing.assert_close(gemv(h, q, scale=s, silu_mul=True, config=row),
                                   gemv(silu_and_mul(h), q, scale=s, config=row), rtol=0, atol=0)
    # kernels.gemv.FP8_LONG_TILES (on): gate_up and down_proj on 2,048-wide K tiles, down_proj unsplit; o_proj as before.
    assert kg.FP8_LONG_TILES
    tiles = {nk: default_config(1, *nk, 1) for nk in [(28672, 4096), (4096, 14336), (4096, 4096)]}
    assert [(c.block_n, c.block_k, c.num_warps) for c in tiles.values()] == [(4, 2048, 2), (16, 2048, 16), (16, 1024, 8)]
    assert tiles[(4096, 14336)].split_k == 1 and not tiles[(28672, 4096)].row_kernel
    kg.FP8_LONG_TILES = False
    try:
        assert (default_config(1, 4096, 14336, 1).block_k, default_config(1, 28672, 4096, 1).block_n) == (1024, 8)
    finally:
        kg.FP8_LONG_TILES = True
    q, s = quantize_per_channel(torch.randn(40, 4608, generator=gen) * 0.02)
    q, s = q.to(device), s.to(device)
    h = torch.randn(1, 2 * 4608, generator=gen).to(device=device, dtype=dtype)
    ref = fp8_linear_ref(silu_and_mul(h).float(), q, s)
    for cfg in tiles.values():  # the long tiles' products, on a ragged K and the gated input
        y = gemv(h, q, scale=s, silu_mul=True, config=cfg).float()
        assert float((y - ref).abs().max()) < (2e-3 if dtype == torch.float32 else 6e-3) * float(ref.abs().max()), cfg


def check_gemv_fp8_rows(device, dtype):
    """FP8 weights with per-row scales against several rows of x (2..64, one tensor-core tile of 16-64 rows): the weight
    tiles widened to x's dtype (weight-only, x not quantized) equal the dequantized reference to within the
    output's rounding, with split K, ragged K, partial tiles and the gated down projection."""
    from kernels.activation import silu_and_mul
    from kernels.gemv import MAX_M, GemvConfig, default_config, gemv
    from kernels.reference import fp8_linear_ref
    from shared.models.quantization import quantize_per_channel
    gen = torch.Generator().manual_seed(3)
    assert MAX_M == 64
    for K, N in [(256, 48), (200, 40)]:
        q, s = quantize_per_channel(torch.randn(N, K, generator=gen) * 0.02)
        q, s = q.to(device), s.to(device)
        for M in (2, 5, 16, 33, 64):
            x = torch.randn(M, K, generator=gen).to(device=device, dtype=dtype)
            ref = fp8_linear_ref(x.float(), q, s)
            tol = (2e-3 if dtype == torch.float32 else 6e-3) * float(ref.abs().max())
            for cfg in (None, GemvConfig(16, 64, 1, 4), GemvConfig(32, 32, 3, 4)):
                y = gemv(x, q, scale=s, config=cfg)
                assert y.shape == (M, N) and y.dtype == dtype
                assert float((y.float() - ref).abs().max()) < tol, (K, N, M, cfg)
        h = torch.randn(3, 2 * K, generator=gen).to(device=device, dtype=dtype)
        torch.testing.assert_close(gemv(h, q, scale=s, silu_mul=True), gemv(silu_and_mul(h), q, scale=s), rtol=0,
                                   atol=0)
    # Past 16 rows the x tile is 32 or 64 rows, and K tiles stay 256 wide (shared memory on sm_90).
    assert [default_config(m, 3072, 5120, 1).block_k for m in (8, 17, 64)] == [512, 256, 256]  # (a shape not swept)
    # kernels.ops' path for a gated MLP's down projection at several FP8 rows: the activation first, then the GEMV.
    import kernels.ops as ops
    on_gpu, max_m = ops._on_gpu, ops.GEMV_MAX_M_FP8
    ops._on_gpu, ops.GEMV_MAX_M_FP8 = (lambda t: True), 16
    try:
        q, s = quantize_per_channel(torch.randn(40, 128, generator=gen) * 0.02)
        q, s = q.to(device), s.to(device)
        h = torch.randn(6, 256, generator=gen).to(device=device, dtype=dtype)
        torch.testing.assert_close(ops.silu_mul_linear(h, q, weight_scale=s), gemv(silu_and_mul(h), q, scale=s),
                                   rtol=0, atol=0)
    finally:
        ops._on_gpu, ops.GEMV_MAX_M_FP8 = on_gpu, max_m


def check_gemv_fp8_down_tiles(device, dtype):
    """FP8 down_proj tiles bench.gemv_chain_sweep --fp8-down-study may pick (kernels.gemv.fp8_tile specs: the general
    kernel unsplit and split in 2 and 4 with tickets, one or two tiles before the PDL wait, the one-row kernel split
    and not) on down_proj's K with the gated input, against the dequantized reference."""
    from bench.gemv_chain_sweep import fp8_down_candidates
    from kernels.activation import silu_and_mul
    from kernels.gemv import fp8_tile, gemv
    from kernels.reference import fp8_linear_ref
    from shared.models.quantization import quantize_per_channel
    gen = torch.Generator().manual_seed(17)
    N, K = (64 if device.type == "cpu" else 4096), 14336
    q, s = quantize_per_channel(torch.randn(N, K, generator=gen) * 0.02)
    q, s = q.to(device), s.to(device)
    h = torch.randn(1, 2 * K, generator=gen).to(device=device, dtype=dtype)
    ref = fp8_linear_ref(silu_and_mul(h).float(), q, s)
    specs = fp8_down_candidates()
    for spec in ("16:2048:8:1:1:0", "16:2048:8:4:2:0", "32:1024:16:2:1:0", "8:4096:16:4:2:0", "8:2048:4:2:2:1",
                 "16:1024:4:1:2:1", "4:4096:4:2:2:1"):
        assert spec in specs, spec
        y = gemv(h, q, scale=s, silu_mul=True, config=fp8_tile(spec)).float()
        tol = 2e-3 if dtype == torch.float32 else 8e-3
        assert float((y - ref).abs().max()) < tol * float(ref.abs().max()), spec


def check_gemv_splitk_tickets(device, dtype):
    """kernels.gemv.SPLITK_TICKETS (on by default): split K reduced by each tile's last split instead of a reduce
    kernel gives the reduce kernel's output bit for bit (plain, gated input, a split norm's consumer and its
    producer: the residual and gamma * residual the same; the norm's sum of squares equal to fp32 rounding, taken a
    tile at a time as without split K), for FP8 and
    16-bit weights, 2-4 splits and a ragged last tile; the counters are left zero and the reduce kernel does not
    run."""
    import kernels.gemv as kg
    from kernels.gemv import GemvConfig, gemv
    from kernels.residual_norm import NORM_SLOTS, ResidualNorm
    from shared.models.quantization import quantize_per_channel
    gen = torch.Generator().manual_seed(21)
    launched = []
    real_reduce = kg._splitk_reduce_kernel
    saved = kg.SPLITK_TICKETS
    try:
        for N, K, split in [(40, 256, 2), (64, 384, 3), (24, 512, 4)]:
            w = torch.randn(N, K, generator=gen) * 0.02
            q, sc = quantize_per_channel(w)
            for wt, scale in ((q.to(device), sc.to(device)), (w.to(device=device, dtype=dtype), None)):
                cfg = GemvConfig(16, 64, split, 2, f16_math=scale is not None, row_kernel=False)
                x = _rand(1, K, dtype=dtype, device=device)
                h = _rand(1, 2 * K, dtype=dtype, device=device)
                r0 = _rand(1, N, dtype=dtype, device=device)
                g = (torch.rand(N, generator=gen) + 0.5).to(device=device, dtype=dtype)
                rk = _rand(1, K, dtype=dtype, device=device)
                runs = []
                for tickets in (False, True):
                    kg.SPLITK_TICKETS = tickets
                    kg._splitk_reduce_kernel = _Launches(real_reduce, launched)
                    launched.clear()
                    sums = torch.zeros(NORM_SLOTS, dtype=torch.float64, device=device)
                    r = r0.clone()
                    produced = gemv(x, wt, scale=scale, config=cfg, add_norm=ResidualNorm(r, g, sums, 1e-6))
                    csums = torch.zeros(NORM_SLOTS, dtype=torch.float64, device=device)
                    csums[3] = float((rk.double() ** 2).sum())
                    consumed = gemv(x, wt, scale=scale, config=cfg, norm_in=ResidualNorm(rk, g[:K] if K <= N else
                                                                                         torch.ones(K, device=device,
                                                                                                    dtype=dtype),
                                                                                         csums, 1e-6))
                    runs.append((gemv(x, wt, scale=scale, config=cfg), gemv(h, wt, scale=scale, config=cfg,
                                                                            silu_mul=True),
                                 produced, r, float(sums.sum()), consumed, len(launched)))
                    kg._splitk_reduce_kernel = real_reduce
                (p, gp, pr, rr, ss, cs, nl), (t, gt, tr, rt, st, ct, tl_) = runs
                what = (N, K, split, scale is not None)
                assert nl == 4 and tl_ == 0, (what, nl, tl_)  # four split launches reduced, none with tickets
                for a, b in ((p, t), (gp, gt), (pr, tr), (rr, rt), (cs, ct)):
                    assert torch.equal(a, b), what
                assert abs(ss - st) <= 1e-6 * abs(ss), what  # summed a tile at a time in fp32, as without a split
                assert int(kg._ticket_counters(x.device).abs().sum()) == 0, what  # the launches' own buffer
    finally:
        kg.SPLITK_TICKETS = saved
        kg._splitk_reduce_kernel = real_reduce


def _block_fp8(N, K, block, gen, device):
    """A random FP8 weight [N, K] with float32 scales [N / bn, K / bk] spread over two decades."""
    from kernels.reference import FP8_DTYPE
    bn, bk = block
    q = (torch.randn(N, K, generator=gen) * 60).clamp(-448, 448).to(FP8_DTYPE)
    s = torch.rand(N // bn, K // bk, generator=gen) * 1e-3 + 1e-5
    return q.to(device), s.to(device)


def check_gemv_fp8_blocks(device, dtype):
    """Block-scaled FP8 weights (scales [N / bn, K / bk]) in the one-row GEMV against the weights dequantized
    block by block: tiles inside one block row and tiles spanning several, blocks narrower and wider than a
    tile along K, split K, a ragged last tile, the gated down projection and a split norm's consumer."""
    from kernels.activation import silu_and_mul
    from kernels.gemv import GemvConfig, gemv
    from kernels.reference import fp8_linear_ref
    from kernels.residual_norm import NORM_SLOTS, ResidualNorm
    gen = torch.Generator().manual_seed(5)
    tol = 2e-3 if dtype == torch.float32 else 6e-3
    for N, K, block in [(64, 256, (16, 32)), (96, 384, (32, 128)), (48, 192, (8, 16)), (128, 1024, (128, 128))]:
        q, s = _block_fp8(N, K, block, gen, device)
        for mag in (0.05, 1.0, 100.0):
            x = (torch.randn(1, K, generator=gen) * mag).to(device=device, dtype=dtype)
            ref = fp8_linear_ref(x.float(), q, s)
            for cfg in (None, GemvConfig(8, 64, 1, 2, f16_math=True, row_kernel=False),
                        GemvConfig(16, 32, 3, 2, f16_math=True, row_kernel=False),
                        GemvConfig(32, 128, 2, 4, f16_math=True, row_kernel=False),
                        GemvConfig(8, 256, 1, 2, f16_math=True, row_kernel=False), GemvConfig(8, 64, 1, 2)):
                y = gemv(x, q, scale=s, config=cfg).float()
                err = float((y - ref).abs().max())
                assert err < tol * float(ref.abs().max()), (N, K, block, mag, cfg, err)
        h = _rand(1, 2 * K, dtype=dtype, device=device)
        torch.testing.assert_close(gemv(h, q, scale=s, silu_mul=True), gemv(silu_and_mul(h), q, scale=s), rtol=0,
                                   atol=0)
        sums = torch.zeros(NORM_SLOTS, dtype=torch.float64, device=device)
        resid = _rand(1, K, dtype=dtype, device=device)
        sums[0] = float((resid.double() ** 2).sum())
        norm = ResidualNorm(resid, torch.ones(K, dtype=dtype, device=device), sums, 1e-6)
        scaled = gemv(resid, q, scale=s, norm_in=norm).float()
        plain = fp8_linear_ref(resid.float(), q, s) / float(torch.sqrt(sums.sum() / K + 1e-6))
        assert float((scaled - plain).abs().max()) < tol * float(plain.abs().max()), (N, K, block)


def check_fp8_block_gemm(device, dtype):
    """The block-scaled FP8 GEMM (kernels/fp8_block_gemm.py) after its per-group activation quantization:
    scales and scaled values exactly the reference's (on a GPU the FP8 bits too), and the product against
    block_fp8_linear_ref (same quantized inputs, fp32 sums) to fp32 rounding, with and without bias, row counts
    across the tile sizes, block rows narrower and wider than a tile."""
    from kernels.activation import silu_and_mul
    from kernels.fp8_block_gemm import block_fp8_gemm, split_k
    from kernels.quant import quantize_per_group
    from kernels.reference import FP8_DTYPE, FP8_MAX, block_fp8_linear_ref, quantize_fp8_per_group_ref
    gen = torch.Generator().manual_seed(6)
    for M, N, K, block in [(3, 96, 64, (32, 16)), (40, 64, 128, (16, 32)), (17, 256, 256, (128, 128)),
                           (70, 192, 128, (64, 64))]:
        q, s = _block_fp8(N, K, block, gen, device)
        x = (torch.randn(M, K, generator=gen) * 3).to(device, dtype)
        h = (torch.randn(M, 2 * K, generator=gen) * 2).to(device, dtype)
        x[-1] = 0  # an all-zero row: the floor on its scales, zeros out
        for inp, gated, ref_in in ((x, False, x), (h, True, silu_and_mul(h))):
            rq, rs = quantize_fp8_per_group_ref(ref_in, block[1])
            v, vs = quantize_per_group(inp, block[1], silu_mul=gated, out_dtype=torch.float32)
            assert torch.equal(vs, rs), (M, K, gated)
            want = (ref_in.float().reshape(M, -1, block[1]) / rs[..., None]).clamp(-FP8_MAX, FP8_MAX)
            assert torch.equal(v, want.reshape(M, K)), (M, K, gated)
            if device.type == "cuda":
                q8, s8 = quantize_per_group(inp, block[1], silu_mul=gated)
                assert q8.dtype == FP8_DTYPE and torch.equal(q8.float(), rq.float()) and torch.equal(s8, rs)
        bias = torch.randn(N, generator=gen).to(device, dtype)
        xq, xs = quantize_fp8_per_group_ref(x, block[1])
        for b in (None, bias):
            ref = block_fp8_linear_ref(x, q, s, b, torch.float32)
            for splits in (None, 1, 2, 4):  # K split over programs, partial sums added by a second kernel
                if splits and (K // block[1]) % splits:
                    continue
                y = block_fp8_gemm(xq, xs, q, s, b, torch.float32, splits=splits)
                # Hopper's FP8 tensor cores keep fewer accumulator bits than fp32 within a product.
                tol = 1e-4 if device.type == "cpu" else 2e-3
                torch.testing.assert_close(y, ref, rtol=tol, atol=tol * float(ref.abs().max()))
        y = block_fp8_gemm(xq, xs, q, s, None, dtype, splits=2 if K // block[1] % 2 == 0 else 1)
        assert y.dtype == dtype and y.shape == (M, N)
    assert split_k(64, 32, 132) == 8 and split_k(64, 8, 132) == 2 and split_k(448, 32, 132) == 1
    assert split_k(16, 8, 132) == 2  # four blocks of K a split at least


def check_gemv_split_norm(device, dtype):
    """A residual RMSNorm split around two GEMVs (kernels/residual_norm.py) against its torch reference: the
    producer's residual and gamma * residual (the same rounded output added as the unfused GEMV's) and its
    partial sums; the consumer's outputs scaled by the norm. The row kernel, the general one, split K (the
    producer's epilogue then in the reduce kernel), FP8 weights, the gated down projection; the first norm
    of a pass clears the sums, more of them than one block."""
    from kernels.gemv import GemvConfig, gemv
    from kernels.norm import rms_norm
    from kernels.reference import gemv_ref, residual_norm_produce_ref, residual_norm_scale_ref, rms_norm_ref
    from kernels.residual_norm import NORM_SLOTS, ResidualNorm
    from shared.models.quantization import quantize_per_channel

    def same(a, b):  # bit for bit where the interpreter runs; within an output rounding on a GPU
        if device.type == "cpu":
            assert torch.equal(a, b), (a - b).abs().max()
        else:
            torch.testing.assert_close(a, b, rtol=8e-3, atol=1e-3)

    H, N2 = (96, 40) if device.type == "cpu" else (4096, 6144)
    producer_cfgs = [None, GemvConfig(8, 32, 1, 2), GemvConfig(4, 32, 3, 2), GemvConfig(16, 32, 1, 4, row_kernel=False)]
    consumer_cfgs = [None, GemvConfig(8, 32, 2, 2), GemvConfig(8, 32, 1, 2, row_kernel=False)]
    gamma = _rand(H, dtype=dtype, device=device)
    for K in ((200,) if device.type == "cpu" else (4096, 14336)):
        for gated in (False, True):
            for fp8 in (False, True):
                w = _rand(H, K, dtype=dtype, device=device) * 0.1
                scale = None
                if fp8:
                    w, scale = (t.to(device) for t in quantize_per_channel(w.float().cpu()))
                x = _rand(1, 2 * K if gated else K, dtype=dtype, device=device)
                r0 = _rand(1, H, dtype=dtype, device=device)
                for cfg in producer_cfgs:
                    r, sums = r0.clone(), torch.zeros(NORM_SLOTS, dtype=torch.float64, device=device)
                    norm = ResidualNorm(r, gamma, sums, 1e-5)
                    g = gemv(x, w, config=cfg, scale=scale, silu_mul=gated, add_norm=norm)
                    r_ref, sums_ref = r0.clone(), torch.zeros_like(sums)
                    g_ref = residual_norm_produce_ref(gemv(x, w, config=cfg, scale=scale, silu_mul=gated),
                                                      ResidualNorm(r_ref, gamma, sums_ref, 1e-5))
                    same(r, r_ref)
                    same(g, g_ref)
                    torch.testing.assert_close(sums.sum(), sums_ref.sum(), rtol=1e-6, atol=0)
                    if cfg is None and not gated:  # the consumer, after each kind of producer weights
                        for w2 in (_rand(N2, H, dtype=dtype, device=device),):
                            for fp8_2 in (False, True):
                                s2 = None
                                if fp8_2:
                                    w2, s2 = (t.to(device) for t in quantize_per_channel(w2.float().cpu()))
                                rs = residual_norm_scale_ref(norm)
                                ref = ((g.float() @ w2.float().t()) * rs).to(dtype)
                                for cfg2 in consumer_cfgs:
                                    y = gemv(g, w2, config=cfg2, scale=s2, norm_in=norm)
                                    msg = f"K={K} {cfg} -> {cfg2} fp8={fp8_2}"
                                    # The scale applied to the fp32 sums: the unscaled GEMV's output times it.
                                    torch.testing.assert_close(
                                        y, (gemv(g, w2, config=cfg2, scale=s2).float() * rs).to(dtype),
                                        **_tol(dtype), msg=lambda m: f"{msg}: {m}")
                                    if s2 is None:
                                        torch.testing.assert_close(y, ref, **_tol(dtype), msg=lambda m: f"{msg}: {m}")
    sums = torch.ones(2000, dtype=torch.float64, device=device)
    x = _rand(1, H, dtype=dtype, device=device)
    torch.testing.assert_close(rms_norm(x, gamma, 1e-5, zero=sums), rms_norm_ref(x, gamma, 1e-5), **_tol(dtype))
    assert not sums.any()


def check_gemv_two_row_norms(device, dtype):
    """kernels.gemv.TWO_ROW_NORMS: split residual norms at two rows on the two-row kernel (each row its own partial
    sums, a row after the other) give each row's one-row split norm at the same tile, bit for bit: the producer
    (residual, gamma * residual, partial sums; its gated input too) and the consumer alone, with the gating epilogue
    and with rope; bf16 and FP8 weights; one launch of the row kernel each. Without the knob two rows refuse them."""
    import dataclasses

    import kernels.gemv as kg
    from kernels.gemv import GemvConfig, gemv
    from kernels.residual_norm import NORM_SLOTS, ResidualNorm
    from kernels.rope_store import RopeStore
    from shared.models.quantization import quantize_per_channel
    gen = torch.Generator().manual_seed(31)
    hq, hkv, d, H, qs, kvs, N, cache = _qkv_heads(device)
    I = 40 if device.type == "cpu" else 14336  # noqa: E741
    gamma = _rand(H, dtype=dtype, device=device)
    r0 = _rand(2, H, dtype=dtype, device=device)
    pos = torch.randint(0, 4096, (2,), generator=gen).to(device)
    loc = (torch.randperm(40, generator=gen)[:2] + 1).to(device)
    pools = lambda: tuple(torch.zeros(41, hkv, d, dtype=dtype, device=device) for _ in range(2))  # noqa: E731
    weights = {name: _rand(n, k, dtype=dtype, device=device) * 0.1
               for name, (n, k) in (("down", (H, I)), ("qkv", (N, H)), ("gate_up", (2 * I, H)))}
    rows, general = [], []
    saved = kg.TWO_ROW_KERNEL, kg.TWO_ROW_KERNEL_FP8, kg.TWO_ROW_EPILOGUES, kg.TWO_ROW_NORMS
    real_row, real_general = kg._gemv_row_kernel, kg._gemv_kernel

    def knobs(on: bool) -> None:  # two rows on the row kernel with FP8 weights, the epilogues and the norms, or plain
        kg.TWO_ROW_KERNEL = True
        kg.TWO_ROW_KERNEL_FP8 = kg.TWO_ROW_EPILOGUES = kg.TWO_ROW_NORMS = on
    try:
        kg._gemv_row_kernel, kg._gemv_kernel = _Launches(real_row, rows), _Launches(real_general, general)
        for fp8 in (False, True):
            ws = {k: ((tuple(t.to(device) for t in quantize_per_channel(w.float().cpu()))) if fp8 else (w, None))
                  for k, w in weights.items()}
            for cfg in (None, GemvConfig(4, 32, 2, 2, narrow=True)):
                if fp8 and cfg is not None:
                    cfg = dataclasses.replace(cfg, f16_math=True)

                def lin(name, x, tiles=None, **kw):  # one of the layer's linears at cfg (or at tiles[name])
                    w, scale = ws[name]
                    return gemv(x, w, config=tiles[name] if tiles else cfg, scale=scale, **kw)
                h = _rand(2, 2 * I, dtype=dtype, device=device)
                knobs(True)
                rows.clear(), general.clear()
                sums = torch.zeros(2, NORM_SLOTS, dtype=torch.float64, device=device)
                r = r0.clone()
                g = lin("down", h, silu_mul=True, add_norm=ResidualNorm(r, gamma, sums, 1e-5))
                norm = ResidualNorm(r, gamma, sums, 1e-5)
                y, yg = lin("qkv", g, norm_in=norm), lin("gate_up", g, norm_in=norm, gated_out=True)
                fused = pools()
                yr = lin("qkv", g, norm_in=norm, rope=RopeStore(pos, cache, *fused, loc, qs, kvs, d))
                msg = f"fp8={fp8} {cfg}"
                assert len(rows) == 4 and not general, (msg, rows, general)
                # each row alone at the tile two rows took (unsplit, as the epilogues run)
                tiles = {k: dataclasses.replace(cfg or kg.two_row_config(*w.shape, w.element_size()), split_k=1)
                         for k, (w, _) in ws.items()}
                knobs(False)
                for i in range(2):
                    ri, si = r0[i:i + 1].clone(), torch.zeros(NORM_SLOTS, dtype=torch.float64, device=device)
                    gi = lin("down", h[i:i + 1], tiles, silu_mul=True, add_norm=ResidualNorm(ri, gamma, si, 1e-5))
                    assert torch.equal(g[i:i + 1], gi) and torch.equal(r[i:i + 1], ri), f"{msg} producer row {i}"
                    assert torch.equal(sums[i].sum(), si.sum()), f"{msg} sums row {i}"
                    ni = ResidualNorm(ri, gamma, si, 1e-5)
                    assert torch.equal(y[i:i + 1], lin("qkv", gi, tiles, norm_in=ni)), f"{msg} row {i}"
                    assert torch.equal(yg[i:i + 1], lin("gate_up", gi, tiles, norm_in=ni, gated_out=True)), \
                        f"{msg} gated row {i}"
                    alone = pools()
                    yri = lin("qkv", gi, tiles, norm_in=ni,
                              rope=RopeStore(pos[i:i + 1], cache, *alone, loc[i:i + 1], qs, kvs, d))
                    assert torch.equal(yr[i:i + 1], yri), f"{msg} rope row {i}"
                    assert all(torch.equal(a[loc[i]], b[loc[i]]) for a, b in zip(fused, alone)), f"{msg} pool row {i}"
        kg.TWO_ROW_KERNEL, kg.TWO_ROW_EPILOGUES = True, True  # without TWO_ROW_NORMS: refused
        try:
            gemv(_rand(2, H, dtype=dtype, device=device), weights["qkv"],
                 norm_in=ResidualNorm(r0.clone(), gamma, torch.zeros(2, NORM_SLOTS, dtype=torch.float64,
                                                                     device=device), 1e-5))
        except AssertionError as e:
            assert "split norms" in str(e)
        else:
            raise AssertionError("two rows took split norms without TWO_ROW_NORMS")
    finally:
        kg.TWO_ROW_KERNEL, kg.TWO_ROW_KERNEL_FP8, kg.TWO_ROW_EPILOGUES, kg.TWO_ROW_NORMS = saved
        kg._gemv_row_kernel, kg._gemv_kernel = real_row, real_general


def check_gemv_rope_store(device, dtype):
    """Rope and the KV store in the qkv GEMV's epilogue (kernels/rope_store.py) against the GEMV followed by
    the rope + KV-store kernel (bit for bit where the interpreter runs) and the torch reference: q and k
    rotated in the output, k and v in the token's pool slot and nowhere else. The row kernel, the general
    one, split K (the epilogue then in the reduce kernel), FP8 weights, a split norm's consumer; head dims
    whose half is not a power of two."""
    import kernels.gemv as kg
    from kernels.gemv import GemvConfig, gemv
    from kernels.reference import rope_cos_sin_cache, rope_store_ref
    from kernels.residual_norm import NORM_SLOTS, ResidualNorm
    from kernels.rope import apply_rope_and_store_kv
    from kernels.rope_store import RopeStore
    from shared.models.quantization import quantize_per_channel

    def same(a, b, msg):  # bit for bit where the interpreter runs; within an output rounding on a GPU
        if device.type == "cpu":
            assert torch.equal(a, b), f"{msg}: {(a.float() - b.float()).abs().max()}"
        else:
            torch.testing.assert_close(a, b, rtol=8e-3, atol=8e-3, msg=lambda m: f"{msg}: {m}")

    shapes = [(4, 2, 16, 96), (3, 1, 24, 200)] if device.type == "cpu" else [(32, 8, 128, 4096), (28, 4, 128, 3584)]
    # (FP8 weights, tiles, a split norm's consumer): row kernel, split K (row and general), general kernel.
    cases = ([(False, None, False), (False, GemvConfig(8, 32, 1, 2), True), (False, GemvConfig(2, 64, 1, 2), False),
              (False, GemvConfig(4, 32, 3, 2), True), (False, GemvConfig(16, 32, 1, 4, row_kernel=False), False),
              (True, None, True), (True, GemvConfig(8, 32, 2, 4, row_kernel=False), False)]
             if device.type == "cpu" else
             [(False, None, False), (False, None, True), (False, GemvConfig(8, 512, 4, 2), True), (True, None, True)])
    for hq, hkv, d, K in shapes:
        qs, kvs = hq * d, hkv * d
        N = qs + 2 * kvs
        inv_freq = 1.0 / (500000 ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
        cache = rope_cos_sin_cache(inv_freq, 4096)
        x = _rand(1, K, dtype=dtype, device=device)
        pos = torch.tensor([3001], device=device)
        loc = torch.tensor([5], device=device)
        w0 = _rand(N, K, dtype=dtype, device=device) * 0.1
        w8, s8 = (t.to(device) for t in quantize_per_channel(w0.float().cpu()))
        for fp8, cfg, norm in cases:
            w, scale = (w8, s8) if fp8 else (w0, None)
            msg = f"hq={hq} hkv={hkv} d={d} fp8={fp8} {cfg} norm_in={norm}"
            sums = torch.full((NORM_SLOTS,), 7.5 * K / NORM_SLOTS, dtype=torch.float64, device=device)
            norm_in = ResidualNorm(x, x[0], sums, 1e-5) if norm else None
            pools = [tuple(torch.zeros(9, hkv, d, dtype=dtype, device=device) for _ in range(2))
                     for _ in range(3)]
            ropes = [RopeStore(pos, cache, kb, vb, loc, qs, kvs, d) for kb, vb in pools]
            y = gemv(x, w, config=cfg, scale=scale, norm_in=norm_in, rope=ropes[0])
            if cfg is None:  # the epilogue's inputs loaded in the program's tail instead: the same bits
                kg.ROPE_INPUTS_AHEAD = False
                try:
                    pool = tuple(torch.zeros(9, hkv, d, dtype=dtype, device=device) for _ in range(2))
                    y_tail = gemv(x, w, scale=scale, norm_in=norm_in, rope=RopeStore(pos, cache, *pool, loc, qs, kvs, d))
                finally:
                    kg.ROPE_INPUTS_AHEAD = True
                assert torch.equal(y_tail, y) and torch.equal(pool[0], pools[0][0]) and torch.equal(pool[1], pools[0][1])
            plain = gemv(x, w, config=cfg, scale=scale, norm_in=norm_in)
            want = rope_store_ref(plain, ropes[1])  # torch
            q, k, v = (t.clone() for t in plain.split([qs, kvs, kvs], dim=-1))
            kb, vb = pools[2]
            q, k, v = apply_rope_and_store_kv(q, k.view(1, hkv, d), v.view(1, hkv, d), pos, cache, d, kb, vb,
                                              loc)
            unfused = torch.cat([q.reshape(1, -1), k.reshape(1, -1), v.reshape(1, -1)], dim=-1)
            same(y, unfused, msg + " (output against GEMV + rope kernel)")
            torch.testing.assert_close(y, want, **_tol(dtype), msg=lambda m: f"{msg} (output): {m}")
            for i, name in ((0, "k"), (1, "v")):
                same(pools[0][i], pools[2][i], f"{msg} ({name} pool)")
                torch.testing.assert_close(pools[0][i], pools[1][i], **_tol(dtype),
                                           msg=lambda m: f"{msg} ({name} pool): {m}")
                others = torch.ones(9, dtype=torch.bool, device=device)
                others[5] = False
                assert not pools[0][i][others].any(), f"{msg}: {name} written outside its slot"
                assert pools[0][i][5].abs().sum() > 0, f"{msg}: {name} not written"
    # An FP8 pool at unit scales (--kv-cache-dtype fp8 without checkpoint scales): the epilogue, in the GEMV and in
    # the split-K reduce, converts k and v as the rope + KV-store kernel does (kv_store.to_pool).
    hq, hkv, d, K = shapes[0]
    qs, kvs = hq * d, hkv * d
    inv_freq = 1.0 / (500000 ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    cache = rope_cos_sin_cache(inv_freq, 4096)
    w = _rand(qs + 2 * kvs, K, dtype=dtype, device=device) * 0.3
    loc = torch.tensor([2], device=device)
    # Several rows: a few hundred values, so some round up into the next binade (what a truncating cast gets wrong).
    configs = [None, GemvConfig(8, 32, 1, 2)] if device.type == "cpu" else [None, GemvConfig(8, 512, 4, 2)]
    for trial, (cfg, pool_dtype) in enumerate(itertools.product(configs, [torch.float8_e4m3fn, torch.float8_e5m2] * 3)):
        x = _rand(1, K, dtype=dtype, device=device)
        pos = torch.tensor([77 + 300 * trial], device=device)
        fused, unfused = (tuple(torch.zeros(4, hkv, d, dtype=pool_dtype, device=device) for _ in range(2))
                          for _ in range(2))
        gemv(x, w, config=cfg, rope=RopeStore(pos, cache, *fused, loc, qs, kvs, d))
        q, k, v = (t.clone() for t in gemv(x, w, config=cfg).split([qs, kvs, kvs], dim=-1))
        apply_rope_and_store_kv(q, k.view(1, hkv, d), v.view(1, hkv, d), pos, cache, d, *unfused, loc)
        for i, name in ((0, "k"), (1, "v")):
            if device.type == "cpu":
                assert torch.equal(fused[i].float(), unfused[i].float()), f"{pool_dtype} {cfg} {name}"
            else:  # (an output rounding apart on a GPU, so an FP8 step at most)
                torch.testing.assert_close(fused[i].float(), unfused[i].float(), rtol=0.13, atol=1e-3)
            assert fused[i][2].float().abs().sum() > 0


def check_gemv_rope_store_rows(device, dtype):
    """Rope and the KV store in the qkv GEMV's epilogue at several rows (the tensor-core tile), each row at its own
    position and pool slot: the output and the pool are those of the plain GEMV (unsplit, at the same tile) followed by
    the rope + KV-store kernel, within an fp32 ulp where the interpreter runs; bf16 and FP8 weights, 3 and 16 rows, a tile
    that would split K (several rows rotate unsplit); nothing written outside the rows' slots."""
    import dataclasses

    from kernels.gemv import GemvConfig, default_config, gemv
    from kernels.rope import apply_rope_and_store_kv
    from kernels.rope_store import RopeStore
    from shared.models.quantization import quantize_per_channel
    gen = torch.Generator().manual_seed(23)
    hq, hkv, d, K, qs, kvs, N, cache = _qkv_heads(device)
    w0 = _rand(N, K, dtype=dtype, device=device) * 0.1
    w8, s8 = (t.to(device) for t in quantize_per_channel(w0.float().cpu()))
    for fp8 in (False, True):
        w, scale = (w8, s8) if fp8 else (w0, None)
        for M in (3, 16):
            x = _rand(M, K, dtype=dtype, device=device)
            pos = torch.randint(0, 4096, (M,), generator=gen).to(device)
            loc = (torch.randperm(40, generator=gen)[:M] + 1).to(device)
            for cfg in (None, GemvConfig(16, 32, 1, 4), GemvConfig(32, 32, 2, 4)):
                msg = f"fp8={fp8} M={M} {cfg}"
                fused, unfused = (tuple(torch.zeros(41, hkv, d, dtype=dtype, device=device) for _ in range(2))
                                  for _ in range(2))
                y = gemv(x, w, config=cfg, scale=scale, rope=RopeStore(pos, cache, *fused, loc, qs, kvs, d))
                base = cfg or default_config(M, N, K, w.element_size())
                plain = gemv(x, w, config=dataclasses.replace(base, split_k=1), scale=scale)
                q, k, v = (t.clone() for t in plain.split([qs, kvs, kvs], dim=-1))
                q, k, v = apply_rope_and_store_kv(q, k.reshape(M, hkv, d), v.reshape(M, hkv, d), pos, cache, d,
                                                  *unfused, loc)
                want = torch.cat([q.reshape(M, -1), k.reshape(M, -1), v.reshape(M, -1)], dim=-1)
                if device.type == "cpu":  # an fp32 ulp apart on some CPUs (the interpreter's dots are numpy's BLAS,
                    # whose kernel differs by CPU: bit for bit on the Intel boxes CI ran on until 12-06, one ulp on an
                    # AMD EPYC's OpenBLAS)
                    torch.testing.assert_close(y, want, rtol=2e-6, atol=2e-6, msg=lambda m: f"{msg}: {m}")
                    for a, b in zip(fused, unfused):
                        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6, msg=lambda m: f"{msg}: {m}")
                else:
                    torch.testing.assert_close(y, want, rtol=8e-3, atol=8e-3, msg=lambda m: f"{msg}: {m}")
                    for a, b in zip(fused, unfused):
                        torch.testing.assert_close(a, b, rtol=8e-3, atol=8e-3, msg=lambda m: f"{msg}: {m}")
                others = torch.ones(41, dtype=torch.bool, device=device)
                others[loc] = False
                assert not any(buf[others].any() for buf in fused), f"{msg}: written outside the rows' slots"
                assert all(bool(buf[loc].abs().sum(dim=(1, 2)).gt(0).all()) for buf in fused), f"{msg}: a slot not written"


def _paged_setup(device, dtype, hkv, d, prefix_lens, extend_lens, num_slots=600):
    """A pool with shuffled slots and a req_to_token table for requests in rows 1..B (row 0 = padding)."""
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    k_buf = _rand(num_slots, hkv, d, dtype=dtype, device=device)
    v_buf = _rand(num_slots, hkv, d, dtype=dtype, device=device)
    perm = torch.randperm(num_slots - 1, device=device) + 1
    r2t = torch.zeros(len(seq_lens) + 2, max(seq_lens) + 3, dtype=torch.int32, device=device)
    used = 0
    for i, n in enumerate(seq_lens):
        r2t[i + 1, :n] = perm[used:used + n].to(torch.int32)
        used += n
    req_idx = torch.arange(1, len(seq_lens) + 1, device=device)
    return k_buf, v_buf, r2t, req_idx, seq_lens


def check_decode_attention(device, dtype):
    from kernels.attention.triton_decode import decode_attention, num_kv_splits_for
    from kernels.reference import decode_attention_ref
    lens = [1, 7, 33, 130]
    for d in _head_dims(device):
        for hq, hkv in [(4, 4), (4, 2), (8, 2)]:
            k_buf, v_buf, r2t, req_idx, seq = _paged_setup(device, dtype, hkv, d, [n - 1 for n in lens],
                                                           [1] * len(lens))
            seq_lens = torch.tensor(seq, dtype=torch.int32, device=device)
            q = _rand(len(lens), hq, d, dtype=dtype, device=device)
            ref = decode_attention_ref(q, k_buf, v_buf, r2t, req_idx, seq_lens, d ** -0.5)
            for max_splits, min_tok in [(1, 256), (4, 16), (8, 1)]:
                splits = num_kv_splits_for(seq_lens, max_splits, min_tok)
                out = decode_attention(q, k_buf, v_buf, r2t, req_idx, seq_lens, splits, max_splits, d ** -0.5)
                torch.testing.assert_close(out, ref, **_tol(dtype),
                                           msg=lambda m: f"d={d} hq={hq} hkv={hkv} splits={max_splits}: {m}")


def check_decode_attention_single_stage(device, dtype):
    """max_kv_splits == 1: one launch, no scratch, the same bits as the two-stage merge (forced here
    through a zero kv_start) and a zero output for a zero-length padding request."""
    from kernels.attention.triton_decode import decode_attention, num_kv_splits_for
    from kernels.reference import decode_attention_ref
    lens = [1, 7, 130, 0]
    for d in _head_dims(device)[:2]:
        for hq, hkv in [(4, 4), (8, 2)]:
            k_buf, v_buf, r2t, req_idx, _ = _paged_setup(device, dtype, hkv, d, [max(0, n - 1) for n in lens],
                                                         [min(1, n) for n in lens])
            seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
            q = _rand(len(lens), hq, d, dtype=dtype, device=device)
            splits = num_kv_splits_for(seq_lens, 1)
            out = decode_attention(q, k_buf, v_buf, r2t, req_idx, seq_lens, splits, 1, d ** -0.5)
            mid_o = torch.full((len(lens), hq, 1, d), float("nan"), device=device)
            mid_lse = torch.full((len(lens), hq, 1), float("nan"), device=device)
            two = decode_attention(q, k_buf, v_buf, r2t, req_idx, seq_lens, splits, 1, d ** -0.5, mid_o=mid_o,
                                   mid_lse=mid_lse, kv_start=torch.zeros_like(seq_lens))
            assert torch.equal(out, two), f"d={d} hq={hq} hkv={hkv}"
            assert torch.equal(out[3], torch.zeros_like(out[3]))
            ref = decode_attention_ref(q[:3], k_buf, v_buf, r2t, req_idx[:3], seq_lens[:3], d ** -0.5)
            torch.testing.assert_close(out[:3], ref, **_tol(dtype))


def _decode_case(device, dtype, lens, hq, hkv, d):
    """One decode batch over a shuffled pool (a zero length: a padding request): (k_buf, v_buf, req_to_token,
    req_idx, seq_lens, the live rows, q, the reference output of the live rows)."""
    from kernels.reference import decode_attention_ref
    k_buf, v_buf, r2t, req_idx, _ = _paged_setup(device, dtype, hkv, d, [max(0, n - 1) for n in lens],
                                                 [min(1, n) for n in lens])
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    live = [i for i, n in enumerate(lens) if n]
    q = _rand(len(lens), hq, d, dtype=dtype, device=device)
    ref = decode_attention_ref(q[live], k_buf, v_buf, r2t, req_idx[live], seq_lens[live], d ** -0.5)
    return k_buf, v_buf, r2t, req_idx, seq_lens, live, q, ref


def check_decode_attention_one_launch(device, dtype):
    """Split decode merged by the last program of each (request, KV head) in the same launch: equal to the
    reference and to the two-launch merge, for batches with uneven per-request split counts (fewer than
    the grid's), contexts shorter than a chunk, a zero-length padding request, and scratch left full of
    NaN by a previous batch; the counters are back at zero after every call, so repeated calls agree."""
    from kernels.attention.triton_decode import decode_attention, num_kv_splits_for
    gen = torch.Generator().manual_seed(11)
    near = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)  # a bf16 ulp
    for lens, (hq, hkv), max_splits in [([1, 7, 33, 130, 0], (4, 2), 4), ([200], (8, 2), 16),
                                        ([65, 3, 129], (8, 1), 8)]:
        d = _head_dims(device)[len(lens) % 2]
        B = len(lens)
        k_buf, v_buf, r2t, req_idx, seq_lens, live, q, ref = _decode_case(device, dtype, lens, hq, hkv, d)
        tickets = torch.zeros(B * hkv + 5, dtype=torch.int32, device=device)
        mid_o = torch.empty((B, hq, max_splits, d), device=device)
        mid_lse = torch.full((B, hq, max_splits), float("nan"), device=device)
        # Per-request counts from the lengths (chunks of >= 16 tokens), and arbitrary ones (1..max_splits,
        # most below the grid's; many chunks of a short context empty).
        uneven = torch.randint(1, max_splits + 1, (B,), generator=gen, dtype=torch.int32).to(device)
        for splits in (num_kv_splits_for(seq_lens, max_splits, 16), uneven):
            two = decode_attention(q, k_buf, v_buf, r2t, req_idx, seq_lens, splits, max_splits, d ** -0.5)
            for call in range(2):
                mid_o.fill_(float("nan"))
                out = decode_attention(q, k_buf, v_buf, r2t, req_idx, seq_lens, splits, max_splits, d ** -0.5,
                                       mid_o=mid_o, mid_lse=mid_lse, tickets=tickets)
                what = f"lens={lens} hq={hq} hkv={hkv} d={d} splits={splits.tolist()} call {call}"
                assert not tickets.any(), f"{what}: counters left at {tickets.tolist()}"
                torch.testing.assert_close(out[live], ref, **_tol(dtype), msg=lambda m: f"{what}: {m}")
                torch.testing.assert_close(out, two, **near, msg=lambda m: f"{what}, against two launches: {m}")
                if len(live) < B:
                    assert torch.equal(out[lens.index(0)], torch.zeros_like(out[0])), what


def check_decode_attention_kv_before_wait(device, dtype):
    """Stage 1 with its chunk's first tile of k and v loaded before the PDL wait and the new token's row after
    it (kernels.attention.triton_decode.KV_BEFORE_WAIT): the same bits as without, one launch and two, a
    single stage, a shared prefix's kv_start, long chunks (more tiles than the first), empty chunks and a
    zero-length padding request; and the reference."""
    import kernels.attention.triton_decode as td
    for lens, (hq, hkv), max_splits, min_tok in [([1, 7, 33, 130, 0], (4, 2), 4, 16), ([200], (8, 2), 16, 1),
                                                 ([300, 65], (8, 1), 2, 64), ([150, 9], (4, 4), 1, 256)]:
        d = _head_dims(device)[len(lens) % 2]
        B = len(lens)
        k_buf, v_buf, r2t, req_idx, seq_lens, live, q, ref = _decode_case(device, dtype, lens, hq, hkv, d)
        splits = td.num_kv_splits_for(seq_lens, max_splits, min_tok)
        saved = td.KV_BEFORE_WAIT
        for how in ("one launch", "two launches", "kv_start"):
            outs = []
            for early in (False, True):
                td.KV_BEFORE_WAIT = early
                try:
                    kw = {}
                    if how == "one launch":
                        kw = dict(tickets=torch.zeros(B * hkv, dtype=torch.int32, device=device))
                    elif how == "kv_start":  # no prefix partials (kv_start 0): the HAS_START kernel
                        kw = dict(kv_start=torch.zeros_like(seq_lens),
                                  mid_o=torch.empty((B, hq, max_splits + 1, d), device=device),
                                  mid_lse=torch.full((B, hq, max_splits + 1), float("-inf"), device=device))
                    outs.append(td.decode_attention(q, k_buf, v_buf, r2t, req_idx, seq_lens, splits, max_splits,
                                                    d ** -0.5, **kw))
                finally:
                    td.KV_BEFORE_WAIT = saved
            what = f"lens={lens} hq={hq} hkv={hkv} splits={splits.tolist()} {how}"
            assert torch.equal(outs[0], outs[1]), what
            torch.testing.assert_close(outs[1][live], ref, **_tol(dtype), msg=lambda m: f"{what}: {m}")


def check_decode_attention_grid_and_tiles(device, dtype):
    """Stage 1's grid in head-major order (`head_major`, HEAD_MAJOR) gives the same bits as request-major, in one
    launch (the ticket counters index by request and KV head either way), two launches and a single stage; other
    tiles (BLOCK_N 32 and 128, more warps and stages: the sweep's) match the reference."""
    import kernels.attention.triton_decode as td
    for lens, (hq, hkv), max_splits, min_tok in [([1, 7, 33, 130, 0], (4, 2), 4, 16), ([300, 65], (8, 1), 2, 64),
                                                 ([150, 9, 270], (4, 4), 1, 256)]:
        d = _head_dims(device)[len(lens) % 2]
        B = len(lens)
        k_buf, v_buf, r2t, req_idx, seq_lens, live, q, ref = _decode_case(device, dtype, lens, hq, hkv, d)
        splits = td.num_kv_splits_for(seq_lens, max_splits, min_tok)
        for how in ("one launch", "two launches"):
            outs = []
            for head_major, tile in [(False, None), (True, None), (False, (32, 4, 3)), (True, (128, 8, 2))]:
                kw = dict(tickets=torch.zeros(B * hkv, dtype=torch.int32, device=device)) if how == "one launch" else {}
                outs.append(td.decode_attention(q, k_buf, v_buf, r2t, req_idx, seq_lens, splits, max_splits,
                                                d ** -0.5, tile=tile, head_major=head_major, **kw))
                what = f"lens={lens} hq={hq} hkv={hkv} splits={splits.tolist()} {how} head_major={head_major} {tile}"
                if "tickets" in kw:
                    assert not kw["tickets"].any(), what
                torch.testing.assert_close(outs[-1][live], ref, **_tol(dtype), msg=lambda m: f"{what}: {m}")
            assert torch.equal(outs[0], outs[1]), f"lens={lens} {how}: head-major order changed the bits"


def check_cascade_decode_attention(device, dtype):
    """Shared-prefix decode: groups whose rows begin with the same slots; the torch cascade reference
    equals plain decode attention, and the Triton kernel equals both (big groups are cut in blocks)."""
    from kernels.attention.triton_cascade import (CascadePlan, CascadeShape, cascade_decode_attention, plan_cascade,
                                                 plan_cascade_host)
    from kernels.attention.triton_decode import num_kv_splits_for
    from kernels.reference import cascade_decode_attention_ref, decode_attention_ref
    gen = torch.Generator().manual_seed(3)
    layouts = [([(70, [0, 2, 5]), (33, [1, 3])], [5, 1, 40, 9, 17, 2, 64]),
               ([(40, list(range(0, 18)))], [1 + (i * 7) % 13 for i in range(19)])]  # cut into blocks at gqa 8
    cpu = device.type == "cpu"  # the interpreter is slow: fewer shapes
    for d in _head_dims(device)[:1 if cpu else 2]:
        for hq, hkv in [(8, 2), (8, 1)] if cpu else [(4, 4), (8, 2), (8, 1)]:
            for li, (groups, suffix) in enumerate(layouts):
                B = len(suffix)
                start = [0] * B
                for plen, mem in groups:
                    for b in mem:
                        start[b] = plen
                seq = [p + n for p, n in zip(start, suffix)]
                n_slots = 8 + sum(p for p, _ in groups) + sum(suffix)
                k_buf = torch.randn(n_slots, hkv, d, generator=gen).to(device, dtype)
                v_buf = torch.randn(n_slots, hkv, d, generator=gen).to(device, dtype)
                r2t = torch.zeros(B + 1, max(seq) + 1, dtype=torch.int32)
                perm = (torch.randperm(n_slots - 8, generator=gen) + 8).to(torch.int32)
                used = 0
                for plen, mem in groups:
                    shared = perm[used:used + plen]
                    used += plen
                    for b in mem:
                        r2t[b + 1, :plen] = shared
                for b in range(B):
                    r2t[b + 1, start[b]:seq[b]] = perm[used:used + suffix[b]]
                    used += suffix[b]
                r2t = r2t.to(device)
                req_idx = torch.arange(1, B + 1, device=device)
                seq_lens = torch.tensor(seq, dtype=torch.int32, device=device)
                q = _rand(B, hq, d, dtype=dtype, device=device)
                ref = decode_attention_ref(q, k_buf, v_buf, r2t, req_idx, seq_lens, d ** -0.5)
                cref = cascade_decode_attention_ref(q, k_buf, v_buf, r2t, req_idx, seq_lens, groups, d ** -0.5)
                torch.testing.assert_close(cref, ref, **_tol(dtype))
                plan = plan_cascade(groups, list(range(1, B + 1)), B, hkv, hq // hkv, device)
                tickets = torch.zeros(B * hkv, dtype=torch.int32, device=device)
                # (4, 8, tickets): the suffix chunks and the prefix's merged in the suffix kernel's launch.
                for max_splits, min_tok, tk in [(4, 8, tickets)] if cpu and li else [(1, 256, None), (4, 8, None),
                                                                                   (4, 8, tickets)]:
                    splits = num_kv_splits_for(seq_lens - plan.kv_start, max_splits, min_tok)
                    out = cascade_decode_attention(q, k_buf, v_buf, r2t, req_idx, seq_lens, plan, splits,
                                                   max_splits, d ** -0.5, tickets=tk)
                    torch.testing.assert_close(out, ref, **_tol(dtype), msg=lambda m: f"d={d} hq={hq} hkv={hkv} B={B} "
                                               f"splits={max_splits} one launch={tk is not None}: {m}")
                    assert not tickets.any()
                # A captured graph's plan: fixed capacities (unused entries, chunks past a group's own
                # count), loaded over a previous batch's contents.
                shape = CascadeShape.for_graph(B + 3, hq // hkv, 2)
                static = CascadePlan.empty(shape, B + 3, device)
                for gs in ([(max(groups[0][0] - 5, 1), groups[0][1][:2])], groups):
                    host = plan_cascade_host(gs, list(range(1, B + 1)), B, hkv, hq // hkv, shape)
                    assert host.fits(shape) and host.num_groups <= shape.max_groups
                    static.load(host, B)
                splits = num_kv_splits_for(seq_lens - static.kv_start[:B], 4, 8)
                out = cascade_decode_attention(q, k_buf, v_buf, r2t, req_idx, seq_lens, static, splits, 4, d ** -0.5,
                                               tickets=tickets if li else None)
                torch.testing.assert_close(out, ref, **_tol(dtype),
                                           msg=lambda m: f"graph plan d={d} hq={hq} hkv={hkv} B={B}: {m}")
                assert not tickets.any()


def _extend_case(device, dtype, hq, hkv, d, prefix, ext):
    """An extend pass over _paged_setup's pool: the pool, table, rows, q, the new tokens' k and v (in the pool, as the
    backend guarantees, and passed packed), the requests' start offsets, and the reference's output."""
    from kernels.reference import extend_attention_ref
    k_buf, v_buf, r2t, req_idx, _ = _paged_setup(device, dtype, hkv, d, prefix, ext)
    q = _rand(sum(ext), hq, d, dtype=dtype, device=device)
    slots = torch.cat([r2t[i + 1, p:p + e] for i, (p, e) in enumerate(zip(prefix, ext))]).long()
    starts = torch.tensor([sum(ext[:i]) for i in range(len(ext))], dtype=torch.int32, device=device)
    ref = extend_attention_ref(q, k_buf, v_buf, r2t, req_idx, prefix, ext, d ** -0.5)
    return k_buf, v_buf, r2t, req_idx, q, k_buf[slots], v_buf[slots], starts, ref


def check_extend_attention(device, dtype):
    from kernels.attention.triton_extend import extend_attention, extend_pack
    # A request with no new tokens is a captured graph's padding row: it must write nothing.
    cases = [([0, 5, 33, 0], [7, 1, 30, 70]), ([130], [33]), ([40, 0, 9], [17, 0, 5])]
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    for d in _head_dims(device)[:2]:
        for hq, hkv in [(4, 4), (4, 2), (8, 2), (12, 2), (8, 1)]:  # groups 1, 2, 4, 6 (packs 2), 8
            for prefix, ext in cases:
                k_buf, v_buf, r2t, req_idx, q, k, v, starts, ref = _extend_case(device, dtype, hq, hkv, d, prefix, ext)
                # pack: query heads per program (None: the kernel's choice); a grid bound above the
                # longest request (as a captured graph has) changes nothing.
                full = extend_pack(hq, hkv)
                assert (hq // hkv) % full == 0 and full & (full - 1) == 0
                for pack, bound in [(None, max(ext)), (1, max(ext)), (full, max(ext) + 40), (max(1, full // 2), max(ext))]:
                    out = extend_attention(q, k, v, k_buf, v_buf, r2t, req_idx, i32(prefix), i32(ext), starts,
                                           bound, d ** -0.5, pack=pack)
                    torch.testing.assert_close(out, ref, **_tol(dtype),
                                               msg=lambda m: f"d={d} hq={hq} hkv={hkv} {prefix} {ext} pack={pack}: {m}")


def check_extend_attention_tma(device, dtype):
    """The new tokens' k and v read by TMA (NEW_KV_TMA): the pointer loads' output (bit for bit interpreted; on a GPU
    within the dtype's tolerance), and the reference's. Requests side by side, so a tile read past one request's end
    holds the next one's rows, which the mask must hide."""
    from kernels.attention.triton_extend import extend_attention, tma_applies
    d = 64
    blk = 32 if device.type == "cpu" else 64  # the tile's key block here
    cases = [([0, 0], [3 * blk + 5, 2 * blk - 3]), ([17, 0, 40], [blk + 1, 2 * blk + 9, 7])]
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    for hq, hkv in [(8, 2), (4, 4)]:
        for prefix, ext in cases:
            k_buf, v_buf, r2t, req_idx, q, k, v, starts, ref = _extend_case(device, dtype, hq, hkv, d, prefix, ext)
            interpreted = device.type == "cpu"
            assert tma_applies(k, v, d) == (interpreted or torch.cuda.get_device_capability(device)[0] >= 9)
            base = extend_attention(q, k, v, k_buf, v_buf, r2t, req_idx, i32(prefix), i32(ext), starts, max(ext),
                                    d ** -0.5, tma=False)
            out = extend_attention(q, k, v, k_buf, v_buf, r2t, req_idx, i32(prefix), i32(ext), starts, max(ext),
                                   d ** -0.5, tma=True)
            msg = f"hq={hq} hkv={hkv} {prefix} {ext}"
            if interpreted:
                assert torch.equal(out, base), msg
            else:
                torch.testing.assert_close(out, base, **_tol(dtype), msg=lambda m: f"{msg}: {m}")
            torch.testing.assert_close(out, ref, **_tol(dtype), msg=lambda m: f"{msg}: {m}")
            # An FP8 pool under the prefix (the new tokens' k and v stay in q's dtype): the same output either way.
            kb8, vb8 = k_buf.to(torch.float8_e4m3fn), v_buf.to(torch.float8_e4m3fn)
            outs = [extend_attention(q, k, v, kb8, vb8, r2t, req_idx, i32(prefix), i32(ext), starts, max(ext), d ** -0.5,
                                     k_scale=0.5, v_scale=2.0, tma=t) for t in (False, True)]
            if interpreted:
                assert torch.equal(*outs), f"FP8 pool: {msg}"
            else:
                torch.testing.assert_close(*outs, **_tol(dtype), msg=lambda m: f"FP8 pool: {msg}: {m}")


def check_per_token_quant(device, dtype):
    """Activation quantization for the FP8 GEMM in one kernel: scales and scaled values exactly the
    reference's (the gated variant: of silu_and_mul's output); on a GPU the FP8 bits too (the
    interpreter truncates FP8 conversions, so the CPU checks the values before that rounding)."""
    from kernels.activation import silu_and_mul
    from kernels.quant import FP8_DTYPE, quantize_per_token
    from kernels.reference import FP8_MAX, quantize_fp8_per_token
    gen = torch.Generator().manual_seed(3)
    for M, K in [(3, 4096), (5, 304), (2, 14336), (1, 16)]:
        x = (torch.randn(M, K, generator=gen) * 3).to(device, dtype)
        h = (torch.randn(M, 2 * K, generator=gen) * 2).to(device, dtype)
        if M > 1:
            x[-1] = 0  # an all-zero row: the floor on its scale, zeros out
        for inp, gated, ref_in in ((x, False, x), (h, True, silu_and_mul(h))):
            rq, rs = quantize_fp8_per_token(ref_in)
            v, s = quantize_per_token(inp, silu_mul=gated, out_dtype=torch.float32)
            assert torch.equal(s, rs), (M, K, gated)
            assert torch.equal(v, (ref_in.float() / rs).clamp(-FP8_MAX, FP8_MAX)), (M, K, gated)
            if device.type == "cuda":
                q, s8 = quantize_per_token(inp, silu_mul=gated)
                assert q.dtype == FP8_DTYPE and q.shape == (M, K) and torch.equal(s8, rs)
                assert torch.equal(q.float(), rq.float()), (M, K, gated)


def check_backend_end_to_end(device, dtype):
    """Extend two requests (one with a cached prefix), then decode two steps, through ForwardBatch,
    with the Triton and torch backends on identical pools: outputs and pool contents must agree. Also over
    FP8 pools with per-layer scales (--kv-cache-dtype fp8_e4m3)."""
    for pool_dtype, scales in ((dtype, None), (torch.float8_e4m3fn, [(0.5, 1.3), (1.0, 0.8)])):
        _backend_end_to_end(device, dtype, pool_dtype, scales)


def _backend_end_to_end(device, dtype, pool_dtype, scales):
    from shared.models.attention import create_attention_backend
    from shared.cache.kv_pool import KVPool, ReqToTokenPool
    from shared.engine.forward_batch import ForwardBatch, ForwardMode
    hq, hkv, d, layers = 4, 2, 16, 2
    worlds = []
    # 1 split: the single-launch decode; one launch: split decode merged in stage 1's launch.
    for name, splits, one in (("torch", 4, False), ("triton", 4, False), ("triton", 1, False), ("triton", 4, True)):
        be = create_attention_backend(name, hq, hkv, d, device=device, max_kv_splits=splits, min_tokens_per_split=8,
                                      one_launch_decode=one)
        worlds.append((be, KVPool(layers, hkv, d, num_pages=64, page_size=4, dtype=pool_dtype, device=device,
                                  scales=scales), ReqToTokenPool(4, 128, device)))
    gen = torch.Generator().manual_seed(0)
    rows = [1, 2]
    steps = [(ForwardMode.EXTEND, [0, 0], [11, 5]), (ForwardMode.EXTEND, [11, 5], [20, 3]),
             (ForwardMode.DECODE, [31, 8], [1, 1]), (ForwardMode.DECODE, [32, 9], [1, 1])]
    next_slot = 4  # page 0 is reserved
    for mode, prefix, ext in steps:
        T = sum(ext)
        locs = torch.arange(next_slot, next_slot + T)
        next_slot += T
        q = torch.randn(T, hq * d, generator=gen).to(device, dtype)
        k = torch.randn(T, hkv * d, generator=gen).to(device, dtype)
        v = torch.randn(T, hkv * d, generator=gen).to(device, dtype)
        outs = []
        for be, pool, r2t in worlds:
            off = 0
            for row, p, e in zip(rows, prefix, ext):
                r2t.write(row, p, locs[off:off + e].to(device))
                off += e
            fb = ForwardBatch.build(mode, [0] * T, rows, prefix, ext, locs, r2t.req_to_token, pool, be, device)
            be.init_forward_metadata(fb)
            if mode == ForwardMode.DECODE and hasattr(be, "max_kv_splits"):  # the triton ones
                assert (be._meta.mid_o is None) == (be.max_kv_splits == 1)
                assert (be._meta.tickets is not None) == (be.one_launch_decode and be.max_kv_splits > 1)
            outs.append(torch.stack([be.forward(q, k, v, layer, fb) for layer in range(layers)]))
            if getattr(be, "_tickets", None) is not None:
                assert not be._tickets.any()
        for out in outs[1:]:
            torch.testing.assert_close(out, outs[0], **_tol(dtype),
                                       msg=lambda m: f"{pool_dtype} {mode} {prefix}: {m}")
    for layer in range(layers):
        for w in worlds[1:]:
            assert torch.equal(worlds[0][1].k_buffers[layer].float(), w[1].k_buffers[layer].float())
            assert torch.equal(worlds[0][1].v_buffers[layer].float(), w[1].v_buffers[layer].float())


def check_backend_extend_decode_tail(device, dtype):
    """An extend pass ending in one-token rows (mixed chunks' riders, catch-up riders): the Triton backend
    runs them with the decode kernel (split or not, merged in one launch or two) where that saves enough of
    the extend grid's empty programs; the same attention as the extend kernel for every row and as the
    torch backend."""
    import shared.models.attention.triton_backend as tb
    from shared.cache.kv_pool import KVPool, ReqToTokenPool
    from shared.engine.forward_batch import ForwardBatch, ForwardMode
    from shared.models.attention import create_attention_backend
    hq, hkv, d = 4, 2, 16
    gen = torch.Generator().manual_seed(3)
    rows = [1, 2, 3, 4, 5, 6, 7]
    prefix = [0, 9, 30, 5, 17, 64, 1]
    ext = [37, 21, 1, 1, 1, 1, 1]  # two prompts, then five riders
    T = sum(ext)
    q = torch.randn(T, hq * d, generator=gen).to(device, dtype)
    k = torch.randn(T, hkv * d, generator=gen).to(device, dtype)
    v = torch.randn(T, hkv * d, generator=gen).to(device, dtype)
    cached = sum(prefix)
    ck = torch.randn(cached, hkv, d, generator=gen).to(device, dtype)
    cv = torch.randn(cached, hkv, d, generator=gen).to(device, dtype)
    outs = []
    saved = tb.DECODE_TAIL_MIN_EMPTY_PROGRAMS
    try:
        for name, min_empty, splits, one in (("torch", 0, 4, False), ("triton", 1 << 30, 4, False),
                                             ("triton", 0, 4, False), ("triton", 0, 4, True), ("triton", 0, 1, False)):
            tb.DECODE_TAIL_MIN_EMPTY_PROGRAMS = min_empty
            be = create_attention_backend(name, hq, hkv, d, device=device, max_kv_splits=splits,
                                          min_tokens_per_split=8, one_launch_decode=one)
            pool = KVPool(1, hkv, d, num_pages=64, page_size=4, dtype=dtype, device=device)
            r2t = ReqToTokenPool(8, 128, device)
            slot, c = 4, 0
            for row, p in zip(rows, prefix):  # the cached prefixes
                locs = torch.arange(slot, slot + p)
                pool.k_buffers[0][locs.to(device)] = ck[c:c + p]
                pool.v_buffers[0][locs.to(device)] = cv[c:c + p]
                r2t.write(row, 0, locs.to(device))
                slot, c = slot + p, c + p
            new = torch.arange(slot, slot + T)
            off = 0
            for row, p, e in zip(rows, prefix, ext):
                r2t.write(row, p, new[off:off + e].to(device))
                off += e
            fb = ForwardBatch.build(ForwardMode.EXTEND, [0] * T, rows, prefix, ext, new, r2t.req_to_token, pool, be,
                                    device)
            be.init_forward_metadata(fb)
            if name == "triton":
                assert (be._meta.tail is not None) == (min_empty == 0), min_empty
                if be._meta.tail is not None:
                    assert (be._meta.head, be._meta.head_tokens) == (2, 58)
            outs.append(be.forward(q, k, v, 0, fb))
            if getattr(be, "_tickets", None) is not None:
                assert not be._tickets.any()
    finally:
        tb.DECODE_TAIL_MIN_EMPTY_PROGRAMS = saved
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], **_tol(dtype))


def check_backend_cascade_decode(device, dtype):
    """A decode batch with prefix groups through the Triton backend equals the torch backend's plain
    decode on the same pool."""
    from shared.models.attention import create_attention_backend
    from shared.cache.kv_pool import KVPool, ReqToTokenPool
    from shared.engine.forward_batch import ForwardBatch, ForwardMode
    hq, hkv, d = 8, 2, 16
    gen = torch.Generator().manual_seed(5)
    pool = KVPool(1, hkv, d, num_pages=256, page_size=1, dtype=dtype, device=device)
    pool.k_buffers[0].copy_(torch.randn(pool.k_buffers[0].shape, generator=gen))
    pool.v_buffers[0].copy_(torch.randn(pool.v_buffers[0].shape, generator=gen))
    r2t = ReqToTokenPool(6, 128, device)
    prefix = torch.arange(1, 41)
    lens = [45, 41, 60, 50, 7]
    nxt = 41
    for row, n in zip(range(1, 6), lens):
        own = torch.arange(nxt, nxt + n)
        nxt += n
        r2t.write(row, 0, torch.cat([prefix, own[40:]]) if row <= 4 else own)
    q = torch.randn(5, hq * d, generator=gen).to(device, dtype)
    outs = []
    # Plain (torch), eager shared-prefix, and the layout a captured graph of batch size 8 reads (the
    # planning and staging a CUDA-graph replay does, the forward run directly); the last two also with
    # the merge in the suffix kernel's launch.
    groups4 = [(40, [0, 1, 2, 3])]
    for name, groups, graph, one in (("torch", None, False, False), ("triton", groups4, False, False),
                                     ("triton", groups4, True, False), ("triton", groups4, False, True),
                                     ("triton", groups4, True, True)):
        be = create_attention_backend(name, hq, hkv, d, device=device,
                                      **({"max_kv_splits": 4, "one_launch_decode": one} if name == "triton" else {}))
        locs = torch.tensor([r2t.req_to_token[i + 1, n - 1].item() for i, n in enumerate(lens)])
        fb = ForwardBatch.build(ForwardMode.DECODE, [0] * 5, [1, 2, 3, 4, 5], [n - 1 for n in lens], [1] * 5, locs,
                                r2t.req_to_token, pool, be, device)
        fb.prefix_groups = groups
        if graph:
            assert be.graph_cascade() and be.plan_graph_cascade(5, groups, [1, 2, 3, 4, 5], 5) is None  # no graph yet
            be._graph_plan(8, device)  # what capturing the graphs of batch sizes 8 and 5 makes
            be._graph_plan(5, device)
            pairs = [(40, [0, 1]), (41, [2, 3]), (42, [4, 5])]  # 3 entries > 8 // min group 4
            assert be.plan_graph_cascade(8, pairs, list(range(1, 9)), 8) is None
            assert be.plan_graph_cascade(8, pairs[:2], list(range(1, 9)), 8) is not None
            plan = be.plan_graph_cascade(5, groups, [1, 2, 3, 4, 5], 5)
            be.load_graph_cascade(5, plan, 5)
            fb.prefix_groups, fb.graph_cascade = None, True
        be.init_forward_metadata(fb)
        if groups:
            assert be._meta.cascade is not None and (be._meta.tickets is not None) == one
        k = pool.k_buffers[0][locs.to(device)].reshape(5, hkv * d).clone()
        v = pool.v_buffers[0][locs.to(device)].reshape(5, hkv * d).clone()
        outs.append(be.forward(q, k, v, 0, fb))
        if one:
            assert not be._meta.tickets.any()
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], **_tol(dtype))


def check_backend_fallback(device, dtype):
    """Head sizes beyond the kernels' tiles run on the torch path instead of failing."""
    from shared.models.attention import create_attention_backend
    be = create_attention_backend("triton", 2, 1, 512, device=device)
    assert be.fallback is not None


CHECKS = {name[len("check_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("check_")}


def _run_worker(names):
    """Runs in the TRITON_INTERPRET=1 subprocess: fp32 on CPU, one JSON line of results."""
    torch.manual_seed(0)
    results = {}
    for name in names:
        try:
            CHECKS[name](torch.device("cpu"), torch.float32)
            results[name] = "ok"
        except Exception:  # report every failure, not just the first
            results[name] = traceback.format_exc()
    print("RESULTS " + json.dumps(results))


# The interpreted checks run in two processes at once (CI has two cores), split by their cost: seconds each took
# alone, interpreted, on a 2-core AMD EPYC box (2026-12-06; 569 s in all). A check not listed counts
# _DEFAULT_COST. Split by hand until then (the FP8 GEMV checks and extend attention in one process, 141 s), the other
# process ran 427 s alone and 483 s in .ci/run, near the limit below.
_INTERPRETED_COST = {
    "extend_attention": 58.9, "gemv_rope_store": 53.9, "gemv_two_row_norms": 44.5, "gemv_gated_out": 43.8,
    "gemv_two_row_epilogues": 40.4, "gemv_fp8_blocks": 37.9, "gemv_two_rows": 31.5, "gemv_split_norm": 29.5,
    "gemv": 28.8, "gemv_fp8_codes": 26.8, "decode_attention": 22.7, "attention_fp8_pool": 20.2,
    "cascade_decode_attention": 17.7, "gemv_fp8_f16_math": 17.7, "gemv_silu_mul": 13.4,
    "decode_attention_one_launch": 10.6, "decode_attention_grid_and_tiles": 9.9,
    "decode_attention_kv_before_wait": 8.6, "backend_end_to_end": 7.9, "gemv_splitk_tickets": 5.8,
    "gemv_row_kernel": 5.7, "gemv_rope_store_rows": 4.7, "extend_attention_tma": 8.0, "fp8_block_gemm": 4.0,
    "gemv_fp8_down_tiles": 4.0, "gemv_fp8_rows": 3.8, "backend_cascade_decode": 2.7, "store_kv_fp8": 2.6,
    "backend_extend_decode_tail": 2.2, "decode_attention_single_stage": 1.9, "gemv_rows": 0.6, "rope_store_kv": 0.6,
    "per_token_quant": 0.3, "rope": 0.2, "store_kv": 0.2, "rms_norm": 0.1, "backend_fallback": 0.0,
    "decode_inputs": 0.0, "embed_rms_norm": 0.0, "silu_and_mul": 0.0}
_DEFAULT_COST = 10.0
_INTERPRETED_TIMEOUT = 600  # seconds for both processes; test_interpreted_cpu's own limit is above it


def _interpreted_groups(names, n: int = 2) -> list[list[str]]:
    """names split into n groups of about equal cost (the costliest first, each to the group with the least)."""
    groups: list[list[str]] = [[] for _ in range(n)]
    loads = [0.0] * n
    for name in sorted(names, key=lambda k: (-_INTERPRETED_COST.get(k, _DEFAULT_COST), k)):
        i = loads.index(min(loads))
        groups[i].append(name)
        loads[i] += _INTERPRETED_COST.get(name, _DEFAULT_COST)
    return [g for g in groups if g]


@pytest.fixture(scope="module")
def interpreted_results():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    groups = _interpreted_groups(CHECKS)
    procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *names], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for names in groups if names]
    results = {}
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=_INTERPRETED_TIMEOUT)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULTS ")]
        assert lines, f"kernel worker crashed (rc={proc.returncode}):\n{out[-3000:]}\n{err[-5000:]}"
        results.update(json.loads(lines[-1][len("RESULTS "):]))
    return results


@pytest.mark.timeout(_INTERPRETED_TIMEOUT + 60)  # the first one waits for the module fixture's two processes
@pytest.mark.parametrize("name", list(CHECKS))
def test_interpreted_cpu(name, interpreted_results):
    assert interpreted_results[name] == "ok", interpreted_results[name]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(CHECKS))
def test_cuda_bf16(name):
    torch.manual_seed(0)
    CHECKS[name](torch.device("cuda"), torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs compute capability >= 9")
def test_cuda_split_norm_producer_late_trigger_in_a_pdl_graph(monkeypatch):
    """A split norm's producer that lets the consumer launch only after its K loop (PRODUCER_LATE_TRIGGER) gives
    the bits of the producer that lets it launch at once: producer, consumer, producer, replayed in a CUDA graph
    under PDL with fresh inputs each time."""
    import kernels.gemv as kg
    from kernels._utils import set_pdl
    from kernels.residual_norm import NORM_SLOTS, ResidualNorm
    torch.manual_seed(0)
    H = 4096
    o = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    wo = torch.randn(H, H, device="cuda", dtype=torch.bfloat16) * 0.02
    wg = torch.randn(2 * 14336, H, device="cuda", dtype=torch.bfloat16) * 0.02
    wd = torch.randn(H, 14336, device="cuda", dtype=torch.bfloat16) * 0.02
    gamma = torch.rand(H, device="cuda", dtype=torch.bfloat16) + 0.5
    r0 = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)

    def run(late):
        monkeypatch.setattr(kg, "PRODUCER_LATE_TRIGGER", late)
        r, sums = r0.clone(), torch.zeros(2, NORM_SLOTS, dtype=torch.float64, device="cuda")
        a, b = ResidualNorm(r, gamma, sums[0], 1e-5), ResidualNorm(r, gamma, sums[1], 1e-5)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            kg.gemv(kg.gemv(kg.gemv(o, wo, add_norm=a), wg, norm_in=a), wd, silu_mul=True, add_norm=b)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = kg.gemv(kg.gemv(kg.gemv(o, wo, add_norm=a), wg, norm_in=a), wd, silu_mul=True, add_norm=b)
        outs = []
        for i in range(5):
            torch.manual_seed(i)
            o.copy_(torch.randn_like(o))
            r.copy_(r0)
            sums.zero_()
            g.replay()
            outs.append((out.clone(), r.clone()))
        return outs

    try:
        set_pdl(True)
        late, early = run(True), run(False)
    finally:
        set_pdl(False)
    for (y1, r1), (y2, r2) in zip(late, early):
        assert torch.equal(r1, r2) and torch.equal(y1, y2)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="bulk L2 prefetch needs compute capability >= 9")
@pytest.mark.parametrize("pdl", [False, True])
def test_cuda_l2_prefetch_between_dependent_kernels_changes_nothing(pdl):
    """A GEMV, the L2 prefetch of the next GEMV's weight, the next GEMV reading the first one's output: eager and
    replayed in a CUDA graph, with and without PDL (the prefetch lets the next kernel launch before it waits, so
    its completion must still imply the first GEMV's), the same bits as without the prefetch."""
    from kernels._utils import set_pdl
    from kernels.gemv import gemv
    from kernels.prefetch import l2_prefetch
    torch.manual_seed(0)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    w2_before = w2.clone()

    def chain(prefetch):
        y = gemv(x, w1)
        if prefetch:
            l2_prefetch(w2)
        return gemv(y, w2)

    try:
        set_pdl(pdl)
        ref = chain(False)
        assert torch.equal(chain(True), ref)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            chain(True)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = chain(True)
        for i in range(20):
            x.copy_(torch.randn_like(x))
            g.replay()
            assert torch.equal(out, chain(False)), i
    finally:
        set_pdl(False)
    assert torch.equal(w2, w2_before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("one_launch", [False, True])
def test_cuda_graph_decode_replay_tracks_new_lengths(one_launch):
    """Capture decode attention (metadata included) once, then replay with longer contexts; with the
    one-launch merge the counters are back at zero after every replay (a replay finding them dirty
    would merge too early or never)."""
    from kernels.attention.triton_decode import decode_attention, num_kv_splits_for, plan_max_kv_splits
    from kernels.reference import decode_attention_ref
    dev, d, hq, hkv = torch.device("cuda"), 128, 32, 8
    k_buf, v_buf, r2t, req_idx, _ = _paged_setup(dev, torch.bfloat16, hkv, d, [900, 40, 3], [100, 1, 1],
                                                 num_slots=2000)
    seq = torch.tensor([10, 7, 1], dtype=torch.int32, device=dev)
    q = _rand(3, hq, d, dtype=torch.bfloat16, device=dev)
    ms = plan_max_kv_splits(3, hkv)
    assert ms > 1
    out = torch.empty_like(q)
    tickets = torch.zeros(3 * hkv, dtype=torch.int32, device=dev) if one_launch else None

    def call():
        decode_attention(q, k_buf, v_buf, r2t, req_idx, seq, num_kv_splits_for(seq, ms), ms, d ** -0.5, out=out,
                         tickets=tickets)
    call()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    for lens in ([10, 7, 1], [1000, 41, 4], [513, 2, 3], [1000, 1000, 64]):
        seq.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(_rand(3, hq, d, dtype=torch.bfloat16, device=dev))
        for _ in range(2):
            out.zero_()
            g.replay()
            ref = decode_attention_ref(q, k_buf, v_buf, r2t, req_idx, seq, d ** -0.5)
            torch.testing.assert_close(out, ref, **_tol(torch.bfloat16))
            assert tickets is None or not tickets.any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_one_launch_decode_matches_two_launches_under_load():
    """Many programs finishing in any order (batch 1 to 64, up to 64 chunks each, shared-prefix columns
    too), each call repeated in one CUDA graph: the one-launch merge gives the two-launch output (within
    a bf16 ulp: the merges sum in other orders), every time, and leaves the counters at zero."""
    from kernels.attention.triton_cascade import cascade_decode_attention, plan_cascade
    from kernels.attention.triton_decode import decode_attention, num_kv_splits_for, plan_max_kv_splits
    dev, dt, d, hq, hkv = torch.device("cuda"), torch.bfloat16, 128, 32, 8
    gen = torch.Generator().manual_seed(17)
    for B in (1, 3, 64):
        lens = torch.randint(1, 4096, (B,), generator=gen).tolist()
        lens[:2] = [max(n, 400) for n in lens[:2]]  # room for the shared prefix below
        k_buf, v_buf, r2t, req_idx, _ = _paged_setup(dev, dt, hkv, d, [n - 1 for n in lens], [1] * B,
                                                     num_slots=sum(lens) + 16)
        seq = torch.tensor(lens, dtype=torch.int32, device=dev)
        q = _rand(B, hq, d, dtype=dt, device=dev)
        ms = plan_max_kv_splits(B, hkv)
        splits = num_kv_splits_for(seq, ms)
        tickets = torch.zeros(B * hkv, dtype=torch.int32, device=dev)
        two = decode_attention(q, k_buf, v_buf, r2t, req_idx, seq, splits, ms, d ** -0.5)
        outs = [torch.empty_like(q) for _ in range(8)]
        g = torch.cuda.CUDAGraph()
        decode_attention(q, k_buf, v_buf, r2t, req_idx, seq, splits, ms, d ** -0.5, tickets=tickets)
        with torch.cuda.graph(g):
            for o in outs:
                decode_attention(q, k_buf, v_buf, r2t, req_idx, seq, splits, ms, d ** -0.5, out=o, tickets=tickets)
        for _ in range(3):
            g.replay()
            for o in outs:
                torch.testing.assert_close(o, two, rtol=1e-2, atol=1e-2, msg=lambda m: f"B={B}: {m}")
                assert torch.equal(o, outs[0]), "the merge's result depends on which program was last"
            assert not tickets.any()
        if B >= 3:  # the first two requests share their first 300 slots (a radix-tree prefix)
            r2t[2, :300] = r2t[1, :300]
            plan = plan_cascade([(300, [0, 1])], req_idx.tolist(), B, hkv, hq // hkv, dev)
            splits = num_kv_splits_for(seq - plan.kv_start, ms)
            ref = cascade_decode_attention(q, k_buf, v_buf, r2t, req_idx, seq, plan, splits, ms, d ** -0.5)
            for _ in range(2):
                one = cascade_decode_attention(q, k_buf, v_buf, r2t, req_idx, seq, plan, splits, ms, d ** -0.5,
                                               tickets=tickets)
                torch.testing.assert_close(one, ref, rtol=1e-2, atol=1e-2)
                assert not tickets.any()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs compute capability >= 9")
@pytest.mark.parametrize("one_launch", [False, True])
def test_cuda_pdl_kernels_match_plain_launches_in_a_graph(one_launch):
    """With PDL each kernel may start while the previous one drains (the GEMV loads its first weight tile
    before waiting): a chain of dependent norm -> GEMV -> rope/KV store -> decode attention -> GEMV
    launches, captured in a CUDA graph and replayed on fresh inputs, gives the same bits as plain launches
    (decode attention merging its chunks in two launches or in one)."""
    from kernels._utils import pdl_launch, set_pdl
    from kernels.attention.triton_decode import decode_attention, num_kv_splits_for, plan_max_kv_splits
    from kernels.gemv import GemvConfig, gemv
    from kernels.norm import rms_norm
    from kernels.rope import apply_rope_and_store_kv
    assert pdl_launch(True) == {"PDL": True, "launch_pdl": True}
    dev, dt, d, hq, hkv, hidden = torch.device("cuda"), torch.bfloat16, 128, 8, 2, 1024
    k_buf, v_buf, r2t, req_idx, _ = _paged_setup(dev, dt, hkv, d, [300], [0], num_slots=600)
    seq = torch.tensor([300], dtype=torch.int32, device=dev)
    loc = r2t[1, 299:300].to(torch.int64)
    pos = torch.tensor([299], dtype=torch.int64, device=dev)
    cs = torch.randn(4096, d, dtype=torch.float32, device=dev)
    wq = _rand((hq + 2 * hkv) * d, hidden, dtype=dt, device=dev)
    wo = _rand(hidden, hq * d, dtype=dt, device=dev)
    nw = _rand(hidden, dtype=dt, device=dev)
    ms = plan_max_kv_splits(1, hkv)
    tickets = torch.zeros(hkv, dtype=torch.int32, device=dev) if one_launch else None
    x = _rand(1, hidden, dtype=dt, device=dev)

    def chain():
        res = x * 0.5
        h, _ = rms_norm(x.clone(), nw, 1e-5, res)
        qkv = gemv(h, wq, config=GemvConfig(4, 256, 2, 2))  # split-K: the reduce kernel chains too
        q, k, v = qkv.view(1, -1, d).split([hq, hkv, hkv], dim=1)
        q, k, _ = apply_rope_and_store_kv(q, k, v, pos, cs, d, k_buf, v_buf, loc)
        o = decode_attention(q.contiguous(), k_buf, v_buf, r2t, req_idx, seq, num_kv_splits_for(seq, ms), ms,
                             d ** -0.5, tickets=tickets)
        return gemv(o.view(1, -1), wo)

    outs = {}
    try:
        for pdl in (False, True, "early"):  # early: each kernel lets the next launch before it waits
            set_pdl(bool(pdl), early_trigger=pdl == "early")
            chain()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y = chain()
            rows = []
            for i in range(3):
                torch.manual_seed(i)
                x.copy_(_rand(1, hidden, dtype=dt, device=dev))
                g.replay()
                rows.append(y.clone())
            outs[pdl] = torch.cat(rows)
    finally:
        set_pdl(False)
    assert torch.equal(outs[False], outs[True])
    assert torch.equal(outs[False], outs["early"])


def test_pdl_early_trigger_is_chosen_per_kernel_family(monkeypatch):
    """PDL = 2 (trigger before the wait) only for the families set_pdl names; 1 for the others; off where
    PDL is off or unsupported (the interpreter, GPUs before Hopper); unknown families are refused."""
    import kernels._utils as ku
    monkeypatch.setattr(ku, "pdl_supported", lambda: True)
    try:
        ku.set_pdl(True, early_trigger="attention+rope")
        assert ku.pdl_launch(family="attention") == {"PDL": 2, "launch_pdl": True}
        assert ku.pdl_launch(family="rope")["PDL"] == 2
        assert ku.pdl_launch(family="gemv") == {"PDL": True, "launch_pdl": True}
        assert ku.pdl_launch(False, "attention") == {"PDL": False}
        ku.set_pdl(False, early_trigger="gemv")
        assert ku.pdl_launch(True, "gemv") == {"PDL": 2, "launch_pdl": True}  # explicit pdl, process's families
        ku.set_pdl(True, early_trigger=True)
        assert all(ku.pdl_launch(family=f)["PDL"] == 2 for f in ku.PDL_FAMILIES)
        monkeypatch.setattr(ku, "pdl_supported", lambda: False)
        assert ku.pdl_launch(family="attention") == {"PDL": False}
        with pytest.raises(ValueError, match="unknown kernel families"):
            ku.set_pdl(True, early_trigger="attention,gemm")
    finally:
        ku.set_pdl(False)


def test_ops_dispatch_cpu_keeps_in_place_contracts():
    """kernels.ops on CPU runs the references but keeps the kernels' in-place behaviour."""
    from kernels import ops
    from kernels.reference import rope_cos_sin_cache, rope_ref
    q, k = torch.randn(3, 2 * 16), torch.randn(3, 16)
    pos = torch.tensor([0, 5, 9])
    cache = rope_cos_sin_cache(1.0 / (10000 ** (torch.arange(0, 16, 2) / 16)), 16)
    q_ref, k_ref = rope_ref(q, k, pos, cache, 16)
    ops.apply_rope(q, k, pos, cache, 16)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    kb, vb = torch.zeros(8, 1, 16), torch.zeros(8, 1, 16)
    ops.store_kv(kb, vb, torch.tensor([3, 6, 1]), k.view(3, 1, 16), k.view(3, 1, 16))
    assert torch.equal(kb[[3, 6, 1]], k.view(3, 1, 16))
    q2, k2, v2 = torch.randn(3, 2, 16), torch.randn(3, 1, 16), torch.randn(3, 1, 16)
    q2_ref, k2_ref = rope_ref(q2, k2, pos, cache, 16)
    ops.apply_rope_and_store_kv(q2, k2, v2, pos, cache, 16, kb, vb, torch.tensor([2, 4, 5]))
    assert torch.equal(q2, q2_ref) and torch.equal(k2, k2_ref)
    assert torch.equal(kb[[2, 4, 5]], k2_ref) and torch.equal(vb[[2, 4, 5]], v2)
    x, w = torch.randn(2, 32), torch.randn(5, 32)
    torch.testing.assert_close(ops.linear(x, w), x @ w.t())
    h = torch.randn(2, 64)
    assert torch.equal(ops.silu_mul_linear(h, w), ops.linear(ops.silu_and_mul(h), w))


def test_l2_prefetch_is_a_no_op_off_cuda():
    from kernels import ops
    t = torch.arange(10.0)
    ops.l2_prefetch(t)
    assert torch.equal(t, torch.arange(10.0))


def test_triton_backend_defaults_are_the_engines():
    """Direct users of the Triton backend (kernel tests, benches) get the decode attention the engine runs: the
    engine's config module does not import the kernels, so the two hold their defaults apart."""
    import inspect

    from kernels.attention.triton_decode import MAX_KV_SPLITS
    from shared.engine.config import EngineConfig
    from shared.models.attention.triton_backend import TritonAttentionBackend
    params = inspect.signature(TritonAttentionBackend.__init__).parameters
    assert params["max_kv_splits"].default == MAX_KV_SPLITS == EngineConfig.triton_attention_num_kv_splits
    assert params["one_launch_decode"].default is EngineConfig.one_launch_decode_attention is True


def test_decode_stage1_tile_over_an_fp8_pool_is_unpipelined(monkeypatch):
    """Stage 1 over an FP8 pool runs one pipeline stage (two: 38% slower at the throughput workload's batch-256
    attention), on two warps up to 16 chunks a request and four past them (bench/RESULTS.md 2026-12-05); a bf16 pool
    keeps (64, 4, 2) whatever the split; the A/B knob still overrides both."""
    import kernels.attention.triton_decode as td

    assert td.stage1_tile(128) == td.stage1_tile(128, max_kv_splits=32) == (64, 4, 2)
    assert td.stage1_tile(128, kv_fp8=True) == td.stage1_tile(128, True, 16) == (64, 2, 1)
    monkeypatch.setattr(td, "num_sms", lambda: 132)  # an H100's, as the plans of the measured batches had them
    assert [td.stage1_tile(128, True, td.plan_max_kv_splits(b, 8)) for b in (1, 8, 64, 256)] == \
        [(64, 4, 1), (64, 2, 1), (64, 2, 1), (64, 2, 1)]
    assert td.stage1_tile(256, kv_fp8=True) == (32, 2, 1)
    monkeypatch.setattr(td, "STAGE1_TILE", (32, 8, 3))
    assert td.stage1_tile(128, kv_fp8=True) == td.stage1_tile(128) == (32, 8, 3)


def test_extend_reads_new_tokens_by_tma_from_256_tokens_a_request(monkeypatch):
    """The prefill kernel takes the new tokens' k and v by TMA (NEW_KV_TMA) in passes whose longest request adds at
    least TMA_MIN_TOKENS, where tma_applies (measured on an H100, bench/RESULTS.md 2026-12-06); shorter passes (the
    short-extend graphs, jump-forward's catch-up) and layouts TMA cannot read keep the pointer loads; tma= overrides."""
    import kernels.attention.triton_extend as te

    launches = []

    class Launch:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append(kw.get("TMA", False))

    monkeypatch.setattr(te, "_extend_kernel", Launch())
    monkeypatch.setattr(te, "_kv_descriptor", lambda t, block_n: ("desc", block_n))
    hq, hkv, d = 8, 2, 64

    def run(max_len, tma=None, kv=None):
        T = max_len
        q = torch.zeros(T, hq, d)
        k = v = kv if kv is not None else torch.zeros(T, hkv, d)
        one = torch.ones(1, dtype=torch.int32)
        te.extend_attention(q, k, v, torch.zeros(4, hkv, d), torch.zeros(4, hkv, d), torch.zeros(2, 4, dtype=torch.int32),
                            one, one * 0, one * T, one * 0, max_len, 0.125, tma=tma)
        return launches.pop()

    monkeypatch.setattr(te, "tma_applies", lambda k, v, block_d: True)
    assert te.NEW_KV_TMA and te.TMA_MIN_TOKENS == 256
    assert [run(n) for n in (64, 255, 256, 4096)] == [False, False, True, True]
    assert run(64, tma=True) and not run(4096, tma=False)
    monkeypatch.setattr(te, "NEW_KV_TMA", False)
    assert not run(4096)
    monkeypatch.setattr(te, "NEW_KV_TMA", True)
    monkeypatch.setattr(te, "tma_applies", lambda k, v, block_d: False)
    assert not run(4096) and not run(4096, tma=True)
    # What TMA can read: heads side by side at a power-of-two head size, 16-byte rows; not a CPU tensor outside
    # the interpreter.
    monkeypatch.undo()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kv = torch.zeros(16, hkv, d, dtype=torch.bfloat16)
    assert te.tma_applies(kv, kv, d)
    assert not te.tma_applies(kv, kv, 128)  # a block wider than the head
    assert not te.tma_applies(kv.transpose(0, 1).contiguous().transpose(0, 1), kv, d)  # heads not side by side
    padded = torch.zeros(16, hkv * d + 4, dtype=torch.bfloat16)[:, :hkv * d].unflatten(1, (hkv, d))
    assert te.tma_applies(kv, kv, d) and not te.tma_applies(padded, kv, d)  # token rows 8 bytes off 16
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not te.tma_applies(kv, kv, d)


def test_interpreted_checks_split_into_two_processes_of_about_equal_cost():
    """Every kernel check runs interpreted exactly once, in one of two processes whose costs differ by less than the
    costliest check (a new check, not yet timed, counts _DEFAULT_COST)."""
    groups = _interpreted_groups(CHECKS)
    assert len(groups) == 2 and sorted(n for g in groups for n in g) == sorted(CHECKS)
    cost = [sum(_INTERPRETED_COST.get(n, _DEFAULT_COST) for n in g) for g in groups]
    assert abs(cost[0] - cost[1]) <= max(_INTERPRETED_COST.values())
    assert set(_INTERPRETED_COST) <= set(CHECKS), "a timed check that no longer exists"
    assert _interpreted_groups(["a"]) == [["a"]]


def test_factory_choices():
    from shared.models.attention import TorchAttentionBackend, create_attention_backend
    assert isinstance(create_attention_backend("auto", 4, 2, 16, device="cpu"), TorchAttentionBackend)
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_attention_backend("nope", 4, 2, 16)
    with pytest.raises(ValueError, match="'flashinfer' is not supported.*use triton.*torch"):
        create_attention_backend("flashinfer", 4, 2, 16)
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        with pytest.raises(ValueError, match="CUDA"):
            create_attention_backend("triton", 4, 2, 16, device="cpu")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _run_worker(sys.argv[1:] or list(CHECKS))


def test_host_lists_reach_the_device_as_torch_tensor_reads_them():
    """kernels.h2d.to_device reads lists through numpy (4x faster than torch.tensor on an 8k-token pass's
    ids, positions and slot table): the same values, dtypes and shapes, nested lists too, and no aliasing of
    a caller's array."""
    import numpy as np

    from kernels.h2d import to_device
    cpu = torch.device("cpu")
    cases = [([3, 1 << 40, -7], torch.int64), ([0, 5, 2 ** 31 - 1], torch.int32), ([True, False], torch.bool),
             ([[1.5, 2.25], [0.1, 3.0]], torch.float32), ([], torch.int64), (list(range(9000)), torch.int32)]
    for values, dtype in cases:
        got = to_device(values, dtype, cpu)
        want = torch.tensor(values, dtype=dtype)
        assert got.dtype == dtype and got.shape == want.shape and torch.equal(got, want)
    arr = np.arange(5, dtype=np.int64)
    got = to_device(arr, torch.int64, cpu)
    arr[0] = 99
    assert got[0] == 0
    t = torch.arange(4)
    assert to_device(t, torch.int32, cpu).dtype == torch.int32
