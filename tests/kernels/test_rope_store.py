"""Rope and the KV store in the qkv GEMV's epilogue (kernels/rope_store.py), and the two-row epilogues."""
from __future__ import annotations

import itertools

import torch

from tests.kernels._helpers import _tol, _rand, _Launches, _qkv_heads
from tests.kernels._runner import kernel_tests


def check_gemv_rope_store(device, dtype):
    """Rope and the KV store in the qkv GEMV's epilogue (kernels/rope_store.py) against the GEMV followed by
    the rope + KV-store kernel (bit for bit where the interpreter runs) and the torch reference: q and k
    rotated in the output, k and v in the token's pool slot and nowhere else. The row kernel, the general
    one, split K (the epilogue then in the reduce kernel), FP8 weights, a split norm's consumer; head dims
    whose half is not a power of two."""
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


def check_gemv_two_row_epilogues(device, dtype):
    """Two rows on the one-row kernel with the rope + KV-store epilogue (each row at its own position and slot) or the
    gating one give each row's one-row GEMV with that epilogue, bit for bit: y and the pool, bf16 weights and FP8 ones
    (at their own row tiles), tiles that would split K; one launch of the row kernel, nothing on the tensor-core tile;
    nothing written outside the rows' slots."""
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
    real_row, real_general = kg._gemv_row_kernel, kg._gemv_kernel
    pools = lambda: tuple(torch.zeros(41, hkv, d, dtype=dtype, device=device) for _ in range(2))  # noqa: E731
    try:
        kg._gemv_row_kernel, kg._gemv_kernel = _Launches(real_row, rows), _Launches(real_general, general)
        for fp8 in (False, True):
            (w_rope, s_rope), (w_gate, s_gate) = quant if fp8 else ((wq, None), (wg, None))
            for cfg in configs:
                if fp8 and cfg is not None:
                    cfg = dataclasses.replace(cfg, f16_math=True)
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
    finally:
        kg._gemv_row_kernel, kg._gemv_kernel = real_row, real_general


test_interpreted_cpu, test_cuda_bf16 = kernel_tests(globals())
