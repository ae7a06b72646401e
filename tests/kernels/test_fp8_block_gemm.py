"""The block-scaled FP8 GEMM (kernels/fp8_block_gemm.py)."""
from __future__ import annotations

import torch

from tests.kernels._helpers import _block_fp8
from tests.kernels._runner import kernel_tests


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


test_interpreted_cpu, test_cuda_bf16 = kernel_tests(globals())
