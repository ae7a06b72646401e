"""The decode GEMV over FP8 weights (kernels/gemv.py): per-row and block scales, f16 math."""
from __future__ import annotations

import torch

from tests.kernels._helpers import _rand, _block_fp8
from tests.kernels._runner import kernel_tests


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
    gen = torch.Generator().manual_seed(1)
    assert default_config(1, 4096, 4096, 1).f16_math and not default_config(1, 4096, 4096, 2).f16_math
    assert not default_config(1, 4096, 4096, 1).row_kernel  # one FP8 row: the general kernel (it measured faster)
    fp8_row = default_config(1, 4096, 4096, 1, fp8_row=True)  # the row tiles two FP8 rows start from
    assert fp8_row.row_kernel and fp8_row.f16_math
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
    # gate_up and down_proj on 2,048-wide K tiles, down_proj unsplit; o_proj on 1,024-wide ones.
    tiles = {nk: default_config(1, *nk, 1) for nk in [(28672, 4096), (4096, 14336), (4096, 4096)]}
    assert [(c.block_n, c.block_k, c.num_warps) for c in tiles.values()] == [(4, 2048, 2), (16, 2048, 16), (16, 1024, 8)]
    assert tiles[(4096, 14336)].split_k == 1 and not tiles[(28672, 4096)].row_kernel
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


test_interpreted_cpu, test_cuda_bf16 = kernel_tests(globals())
