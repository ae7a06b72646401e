"""RMSNorm kernels (kernels/norm.py): the norm with its residual add, and the embedding lookup with the first norm."""
from __future__ import annotations

import torch

from tests.kernels._helpers import _tol, _rand
from tests.kernels._runner import kernel_tests


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


test_interpreted_cpu, test_cuda_bf16 = kernel_tests(globals())
