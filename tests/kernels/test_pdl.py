"""Programmatic dependent launch (kernels/_utils.py): per-family triggers, PDL launches in a CUDA graph."""
from __future__ import annotations

import pytest
import torch

from tests.kernels._helpers import _rand, _paged_setup


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


@pytest.mark.gpu
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
