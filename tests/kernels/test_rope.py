"""Rotary embedding (kernels/rope.py), alone and with the KV store."""
from __future__ import annotations

import torch

from tests.kernels._helpers import _tol, _rand
from tests.kernels._runner import kernel_tests


def check_rope(device, dtype):
    from kernels.reference import rope_cos_sin_cache, rope_ref
    from kernels.rope import apply_rope
    for T, hq, hkv, d, rot in [(7, 4, 2, 16, 16), (3, 4, 1, 32, 16), (1, 2, 2, 16, 16)]:
        inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32, device=device) / rot))
        cache = rope_cos_sin_cache(inv_freq, 300)
        qkv = _rand(T, (hq + 2 * hkv) * d, dtype=dtype, device=device)
        q, k = qkv[:, :hq * d], qkv[:, hq * d:(hq + hkv) * d]  # strided views, as a fused qkv gives
        pos = torch.randint(0, 300, (T,), device=device)
        q_ref, k_ref = rope_ref(q.clone(), k.clone(), pos, cache, d)
        v_before = qkv[:, (hq + hkv) * d:].clone()
        apply_rope(q, k, pos, cache, d)
        torch.testing.assert_close(q, q_ref, **_tol(dtype))
        torch.testing.assert_close(k, k_ref, **_tol(dtype))
        assert torch.equal(qkv[:, (hq + hkv) * d:], v_before), "rope must not touch v"
        # [T, H, D] views work too.
        q3 = _rand(T, hq, d, dtype=dtype, device=device)
        k3 = _rand(T, hkv, d, dtype=dtype, device=device)
        q3_ref, k3_ref = rope_ref(q3.clone(), k3.clone(), pos, cache, d)
        apply_rope(q3, k3, pos, cache, d)
        torch.testing.assert_close(q3, q3_ref, **_tol(dtype))
        torch.testing.assert_close(k3, k3_ref, **_tol(dtype))


def check_rope_store_kv(device, dtype):
    """The fused rope + KV store equals rope then store_kv bit for bit (q, k in place and the pool),
    and the references; partial rotary (rotary dim < head dim) stores the unrotated tail too."""
    from kernels.kv_store import store_kv
    from kernels.reference import rope_cos_sin_cache, rope_ref, store_kv_ref
    from kernels.rope import apply_rope, apply_rope_and_store_kv
    for T, hq, hkv, d, rot in [(1, 4, 2, 16, 16), (7, 4, 2, 16, 16), (3, 8, 1, 32, 16), (5, 6, 3, 24, 24)]:
        inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32, device=device) / rot))
        cache = rope_cos_sin_cache(inv_freq, 300)
        qkv = _rand(T, (hq + 2 * hkv) * d, dtype=dtype, device=device)
        pos = torch.randint(0, 300, (T,), device=device)
        loc = torch.randperm(40, device=device)[:T]
        worlds = []
        for fused in (True, False):
            x = qkv.clone()
            q = x[:, :hq * d]
            k = x[:, hq * d:(hq + hkv) * d].view(T, hkv, d)
            v = x[:, (hq + hkv) * d:].view(T, hkv, d)
            kb, vb = (torch.zeros(40, hkv, d, dtype=dtype, device=device) for _ in range(2))
            if fused:
                apply_rope_and_store_kv(q, k, v, pos, cache, d, kb, vb, loc)
            else:
                apply_rope(q, k, pos, cache, d)
                store_kv(kb, vb, loc, k, v)
            worlds.append((x, kb, vb))
        for a, b in zip(*worlds):
            assert torch.equal(a, b), f"fused rope+store differs from rope then store_kv (T={T} d={d} rot={rot})"
        # out=True: the same q, k, v bits as new contiguous [T, H, D] tensors, the inputs untouched, the
        # same pool writes.
        x = qkv.clone()
        q, k, v = x[:, :hq * d], x[:, hq * d:(hq + hkv) * d], x[:, (hq + hkv) * d:]
        kb, vb = (torch.zeros(40, hkv, d, dtype=dtype, device=device) for _ in range(2))
        qo, ko, vo = apply_rope_and_store_kv(q, k, v, pos, cache, d, kb, vb, loc, out=True)
        assert torch.equal(x, qkv), "out=True must leave q, k, v as they were"
        rotated = worlds[0][0]
        for got, want, h in [(qo, rotated[:, :hq * d], hq), (ko, rotated[:, hq * d:(hq + hkv) * d], hkv),
                             (vo, rotated[:, (hq + hkv) * d:], hkv)]:
            assert got.is_contiguous() and got.shape == (T, h, d)
            assert torch.equal(got, want.reshape(T, h, d)), f"out=True differs (T={T} d={d} rot={rot})"
        assert torch.equal(kb, worlds[0][1]) and torch.equal(vb, worlds[0][2])
        x, kb, vb = worlds[0]
        q_ref, k_ref = rope_ref(qkv[:, :hq * d], qkv[:, hq * d:(hq + hkv) * d], pos, cache, d)
        kb_ref, vb_ref = torch.zeros_like(kb), torch.zeros_like(vb)
        store_kv_ref(kb_ref, vb_ref, loc, k_ref.view(T, hkv, d), qkv[:, (hq + hkv) * d:].view(T, hkv, d))
        torch.testing.assert_close(x[:, :hq * d], q_ref, **_tol(dtype))
        torch.testing.assert_close(kb, kb_ref, **_tol(dtype))
        assert torch.equal(vb, vb_ref)


test_interpreted_cpu, test_cuda_bf16 = kernel_tests(globals())
