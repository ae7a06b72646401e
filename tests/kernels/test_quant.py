"""Per-token FP8 quantization of activations (kernels/quant.py)."""
from __future__ import annotations

import torch

from tests.kernels._runner import kernel_tests


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


test_interpreted_cpu, test_cuda_bf16 = kernel_tests(globals())
