"""Residual RMSNorms split into the GEMVs around them (kernels/residual_norm.py), one row and two."""
from __future__ import annotations

import torch

from tests.kernels._helpers import _tol, _rand, _Launches, _qkv_heads
from tests.kernels._runner import kernel_tests


def check_gemv_split_norm(device, dtype):
    """A residual RMSNorm split around two GEMVs (kernels/residual_norm.py) against its torch reference: the
    producer's residual and gamma * residual (the same rounded output added as the unfused GEMV's) and its
    partial sums; the consumer's outputs scaled by the norm. The row kernel, the general one, split K (the
    producer's epilogue then in the reduce kernel), FP8 weights, the gated down projection; the first norm
    of a pass clears the sums, more of them than one block."""
    from kernels.gemv import GemvConfig, gemv
    from kernels.norm import rms_norm
    from kernels.reference import residual_norm_produce_ref, residual_norm_scale_ref, rms_norm_ref
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
    """Split residual norms at two rows on the one-row kernel (each row its own partial sums, a row after the other)
    give each row's one-row split norm at the same tile, bit for bit: the producer (residual, gamma * residual, partial
    sums; its gated input too) and the consumer alone, with the gating epilogue and with rope; bf16 and FP8 weights;
    one launch of the row kernel each. Two rows on the tensor-core tile refuse them."""
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
    real_row, real_general = kg._gemv_row_kernel, kg._gemv_kernel
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
        try:  # two rows on the tensor-core tile: refused
            gemv(_rand(2, H, dtype=dtype, device=device), weights["qkv"], tensor_cores=True,
                 norm_in=ResidualNorm(r0.clone(), gamma, torch.zeros(2, NORM_SLOTS, dtype=torch.float64,
                                                                     device=device), 1e-5))
        except AssertionError as e:
            assert "split norms" in str(e)
        else:
            raise AssertionError("two rows on the tensor-core tile took split norms")
    finally:
        kg._gemv_row_kernel, kg._gemv_kernel = real_row, real_general


test_interpreted_cpu, test_cuda_bf16 = kernel_tests(globals())
