"""The KV-pool store (kernels/kv_store.py), 16-bit and FP8 pools."""
from __future__ import annotations

import torch

from tests.kernels._helpers import _rand
from tests.kernels._runner import kernel_tests


def check_store_kv(device, dtype):
    from kernels.kv_store import store_kv
    from kernels.reference import store_kv_ref
    for T, h, d in [(1, 2, 16), (9, 3, 24), (33, 8, 32)]:
        kv = _rand(T, 2, h, d, dtype=dtype, device=device)
        k, v = kv[:, 0], kv[:, 1]  # non-contiguous views
        loc = torch.randperm(64, device=device)[:T]
        bufs = [torch.zeros(64, h, d, dtype=dtype, device=device) for _ in range(4)]
        store_kv(bufs[0], bufs[1], loc, k, v)
        store_kv_ref(bufs[2], bufs[3], loc, k, v)
        assert torch.equal(bufs[0], bufs[2]) and torch.equal(bufs[1], bufs[3])


def check_store_kv_fp8(device, dtype):
    """FP8 pools (e4m3 and e5m2, with and without per-layer scales): store_kv and the fused rope + KV store
    write what kernels.reference.to_pool_ref does (x / scale saturated and rounded to nearest even; compared
    as values, -0 == 0), including values past the format's range and in its subnormals."""
    from kernels.kv_store import store_kv
    from kernels.reference import rope_cos_sin_cache, rope_ref, to_pool_ref
    from kernels.rope import apply_rope_and_store_kv
    T, hq, hkv, d = 24, 4, 2, 16
    mag = torch.logspace(-6, 3.5, T, device=device)[:, None, None]  # subnormal .. past e4m3's 448
    for pool in (torch.float8_e4m3fn, torch.float8_e5m2):
        for ks, vs in [(1.0, 1.0), (0.37, 2.5)]:
            kv = _rand(T, 2, hkv, d, dtype=torch.float32, device=device)
            k, v = (kv[:, 0] * mag).to(dtype), (kv[:, 1] * mag).to(dtype)
            loc = torch.randperm(64, device=device)[:T]
            kb, vb = (torch.zeros(64, hkv, d, dtype=pool, device=device) for _ in range(2))
            store_kv(kb, vb, loc, k, v, ks, vs)
            assert torch.equal(kb[loc].float(), to_pool_ref(k, ks, pool).float()), f"{pool} k scale {ks}"
            assert torch.equal(vb[loc].float(), to_pool_ref(v, vs, pool).float()), f"{pool} v scale {vs}"
            assert not kb.float().isnan().any() and kb.float().abs().max() <= torch.finfo(pool).max
            # The fused rope + store: the rotated k (as rope_ref rounds it) converted the same way.
            inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
            cache = rope_cos_sin_cache(inv_freq, 300)
            q = _rand(T, hq * d, dtype=dtype, device=device)
            pos = torch.randint(0, 300, (T,), device=device)
            kb2, vb2 = (torch.zeros(64, hkv, d, dtype=pool, device=device) for _ in range(2))
            _, k_rot = rope_ref(q, k.reshape(T, -1).clone(), pos, cache, d)
            apply_rope_and_store_kv(q.clone(), k.reshape(T, -1).clone(), v, pos, cache, d, kb2, vb2, loc, k_scale=ks,
                                    v_scale=vs)
            ref_k = to_pool_ref(k_rot.view(T, hkv, d), ks, pool).float()
            # rope in the kernel and in rope_ref may differ in k's last bit, which can move an FP8 rounding by a step
            torch.testing.assert_close(kb2[loc].float(), ref_k, rtol=0.13, atol=1e-6)
            assert (kb2[loc].float() == ref_k).float().mean() > 0.95, f"{pool} rope+store"
            assert torch.equal(vb2[loc].float(), to_pool_ref(v, vs, pool).float())


test_interpreted_cpu, test_cuda_bf16 = kernel_tests(globals())
