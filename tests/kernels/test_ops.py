"""kernels/ops.py: the device dispatch's CPU path and its in-place contracts; L2 prefetch (kernels/prefetch.py)."""
from __future__ import annotations

import pytest
import torch


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


@pytest.mark.gpu
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
