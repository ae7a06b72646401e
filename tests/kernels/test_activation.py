"""silu_and_mul (kernels/activation.py)."""
from __future__ import annotations

import torch

from tests.kernels._helpers import _tol, _rand
from tests.kernels._runner import kernel_tests


def check_silu_and_mul(device, dtype):
    from kernels.activation import silu_and_mul
    from kernels.reference import silu_and_mul_ref
    for T, I in [(1, 16), (7, 130), (2, 1100)]:
        x = _rand(T, 2 * I, dtype=dtype, device=device)
        torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), **_tol(dtype))


test_interpreted_cpu, test_cuda_bf16 = kernel_tests(globals())
