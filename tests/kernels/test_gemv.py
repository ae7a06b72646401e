"""The decode GEMV (kernels/gemv.py): one row, several rows on the tensor-core tile, two rows on the one-row
kernel, the gated input and output, split K with and without tickets."""
from __future__ import annotations

import torch

from tests.kernels._helpers import _tol, _rand, _Launches
from tests.kernels._runner import kernel_tests


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
    shapes the tile tables list, with ragged N and split K; the "bf16_rows" table (kernels/configs/gemv.json) overrides
    the default tile of the shapes it lists, and only at several rows."""
    import kernels.gemv as g
    from kernels._utils import tile_table
    from kernels.reference import gemv_ref
    shapes = [(256, 130)] + ([(4096, 6144), (14336, 4096)] if device.type == "cuda" else [])
    for K, N in shapes:
        w = _rand(N, K, dtype=dtype, device=device)
        for M in (5, 16):
            x = _rand(M, K, dtype=dtype, device=device)
            for cfg in (g.GemvConfig(64, 128, 1, 8), g.GemvConfig(128, 128, 2, 8), g.GemvConfig(16, 256, 1, 4)):
                torch.testing.assert_close(g.gemv(x, w, config=cfg), gemv_ref(x, w), **_tol(dtype),
                                           msg=lambda m: f"K={K} N={N} M={M} {cfg}: {m}")
    table = tile_table("gemv", "bf16_rows")
    try:
        table[130, 256] = (32, 64, 4)
        cfg = g.default_config(8, 130, 256)
        assert (cfg.block_n, cfg.block_k, cfg.num_warps) == (32, 64, 4)
        assert g.default_config(1, 130, 256) != cfg and g.default_config(8, 130, 256, 1) != cfg
        w, x = _rand(130, 256, dtype=dtype, device=device), _rand(8, 256, dtype=dtype, device=device)
        torch.testing.assert_close(g.gemv(x, w), gemv_ref(x, w), **_tol(dtype))
    finally:
        del table[130, 256]


def check_gemv_two_rows(device, dtype):
    """Two rows on the one-row kernel (each weight tile against both) give each row's one-row GEMV bit for bit: the
    row tiles' variants (x through w-shaped pointers or one broadcast row, folds, narrow accumulators, two tiles before
    the PDL wait), split K, ragged K, the gated input, FP8 weights at their row tiles, and a strided x and output."""
    import kernels.gemv as kg
    from kernels._utils import tile_table
    from kernels.gemv import GemvConfig, gemv
    from shared.models.quantization import quantize_per_channel
    shapes = [(64, 48), (200, 37)] + ([(4096, 6144), (14336, 4096)] if device.type == "cuda" else [])
    configs = [None, GemvConfig(16, 32, 1, 4), GemvConfig(2, 64, 1, 1, pre_tiles=2, narrow=True),
               GemvConfig(4, 16, 1, 1, fold=3), GemvConfig(8, 16, 2, 2, fold=2, narrow=True),
               GemvConfig(4, 256, 1, 2, narrow=True), GemvConfig(8, 32, 2, 2, pre_tiles=2, f16_math=True)]
    launched = []
    real = kg._gemv_row_kernel
    tiles = tile_table("gemv", "two_row")
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
                    launched.clear()
                    out = torch.full((2, N + 5), 7.0, dtype=dtype, device=device)[:, :N]
                    y = gemv(xs, wt, out=out, config=cfg, scale=scale)
                    yg = gemv(h, wt, config=cfg, scale=scale, silu_mul=True)
                    # the reference: one row at the tile two rows took (two_row_config's where none is given: on
                    # Llama's shapes its K tile is not the one-row default's, so the sums' order differs)
                    ref = cfg or kg.two_row_config(N, K, wt.element_size())
                    assert not kg.on_tensor_cores(2, wt, scale) or cfg is not None
                    assert launched, (K, N, cfg)  # 16-bit and FP8 weights both reach the row kernel
                    for r in range(2):
                        msg = f"K={K} N={N} {cfg} fp8={scale is not None} row {r}"
                        assert torch.equal(y[r:r + 1], gemv(xs[r:r + 1], wt, config=ref, scale=scale)), msg
                        one = gemv(h[r:r + 1], wt, config=ref, scale=scale, silu_mul=True)
                        if scale is not None and device.type == "cuda":  # FP8's f16 products of the activation
                            # computed in the load: the compiled two-row and one-row kernels may round silu(g)·u
                            # apart before its f16 cast (1 bf16 ulp at Llama's qkv shape, tile (2, 512, 2)); the
                            # interpreter computes both alike, and is held to the bits
                            torch.testing.assert_close(yg[r:r + 1], one, rtol=2 ** -6, atol=0.125, msg=msg)
                        else:
                            assert torch.equal(yg[r:r + 1], one), msg
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
            for wt, scale in ((w, None), (q, sq)):  # bf16 weights, then FP8 ones
                acts.clear()
                y = ops.silu_mul_linear(h, wt, None, scale)
                ref = kg.two_row_config(40, 64, wt.element_size())
                assert acts == [], (scale is not None, acts)
                assert all(torch.equal(y[r:r + 1], gemv(h[r:r + 1], wt, config=ref, scale=scale, silu_mul=True))
                           for r in range(2))
        finally:
            ops._on_gpu, ops.GEMV_MAX_M, ops.silu_and_mul = on_gpu, max_m, sm
        # the "two_row" tile table (a sweep's picks) overrides two_row_config's rule for the shapes it lists
        tiles[48, 64] = (4, 32, 2)
        cfg = kg.two_row_config(48, 64)
        assert (cfg.block_n, cfg.block_k, cfg.num_warps, cfg.narrow, cfg.row_kernel) == (4, 32, 2, True, True)
        assert kg.two_row_config(40, 64) != cfg
        w, x = _rand(48, 64, dtype=dtype, device=device), _rand(2, 64, dtype=dtype, device=device)
        y = gemv(x, w)
        assert all(torch.equal(y[r:r + 1], gemv(x[r:r + 1], w, config=cfg)) for r in range(2))
    finally:
        tiles.pop((48, 64), None)
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


def check_gemv_splitk_tickets(device, dtype):
    """Split K reduced by each tile's last split (one row, the general kernel) instead of a reduce kernel gives the
    reduce kernel's output (where a launch has more tiles than ticket counters) bit for bit (plain, gated input, a split norm's consumer and its
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
    real_reduce, slots = kg._splitk_reduce_kernel, kg._TICKET_SLOTS
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
                    kg._TICKET_SLOTS = slots if tickets else 0
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
        kg._TICKET_SLOTS = slots
        kg._splitk_reduce_kernel = real_reduce


test_interpreted_cpu, test_cuda_bf16 = kernel_tests(globals())
