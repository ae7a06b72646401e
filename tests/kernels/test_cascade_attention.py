"""Shared-prefix (cascade) decode attention (kernels/attention/triton_cascade.py)."""
from __future__ import annotations

import torch

from tests.kernels._helpers import _tol, _head_dims, _rand
from tests.kernels._runner import kernel_tests


def check_cascade_decode_attention(device, dtype):
    """Shared-prefix decode: groups whose rows begin with the same slots; the torch cascade reference
    equals plain decode attention, and the Triton kernel equals both (big groups are cut in blocks)."""
    from kernels.attention.triton_cascade import (CascadePlan, CascadeShape, cascade_decode_attention, plan_cascade,
                                                 plan_cascade_host)
    from kernels.attention.triton_decode import num_kv_splits_for
    from kernels.reference import cascade_decode_attention_ref, decode_attention_ref
    gen = torch.Generator().manual_seed(3)
    layouts = [([(70, [0, 2, 5]), (33, [1, 3])], [5, 1, 40, 9, 17, 2, 64]),
               ([(40, list(range(0, 18)))], [1 + (i * 7) % 13 for i in range(19)])]  # cut into blocks at gqa 8
    cpu = device.type == "cpu"  # the interpreter is slow: fewer shapes
    for d in _head_dims(device)[:1 if cpu else 2]:
        for hq, hkv in [(8, 2), (8, 1)] if cpu else [(4, 4), (8, 2), (8, 1)]:
            for li, (groups, suffix) in enumerate(layouts):
                B = len(suffix)
                start = [0] * B
                for plen, mem in groups:
                    for b in mem:
                        start[b] = plen
                seq = [p + n for p, n in zip(start, suffix)]
                n_slots = 8 + sum(p for p, _ in groups) + sum(suffix)
                k_buf = torch.randn(n_slots, hkv, d, generator=gen).to(device, dtype)
                v_buf = torch.randn(n_slots, hkv, d, generator=gen).to(device, dtype)
                r2t = torch.zeros(B + 1, max(seq) + 1, dtype=torch.int32)
                perm = (torch.randperm(n_slots - 8, generator=gen) + 8).to(torch.int32)
                used = 0
                for plen, mem in groups:
                    shared = perm[used:used + plen]
                    used += plen
                    for b in mem:
                        r2t[b + 1, :plen] = shared
                for b in range(B):
                    r2t[b + 1, start[b]:seq[b]] = perm[used:used + suffix[b]]
                    used += suffix[b]
                r2t = r2t.to(device)
                req_idx = torch.arange(1, B + 1, device=device)
                seq_lens = torch.tensor(seq, dtype=torch.int32, device=device)
                q = _rand(B, hq, d, dtype=dtype, device=device)
                ref = decode_attention_ref(q, k_buf, v_buf, r2t, req_idx, seq_lens, d ** -0.5)
                cref = cascade_decode_attention_ref(q, k_buf, v_buf, r2t, req_idx, seq_lens, groups, d ** -0.5)
                torch.testing.assert_close(cref, ref, **_tol(dtype))
                plan = plan_cascade(groups, list(range(1, B + 1)), B, hkv, hq // hkv, device)
                tickets = torch.zeros(B * hkv, dtype=torch.int32, device=device)
                # (4, 8, tickets): the suffix chunks and the prefix's merged in the suffix kernel's launch.
                for max_splits, min_tok, tk in [(4, 8, tickets)] if cpu and li else [(1, 256, None), (4, 8, None),
                                                                                   (4, 8, tickets)]:
                    splits = num_kv_splits_for(seq_lens - plan.kv_start, max_splits, min_tok)
                    out = cascade_decode_attention(q, k_buf, v_buf, r2t, req_idx, seq_lens, plan, splits,
                                                   max_splits, d ** -0.5, tickets=tk)
                    torch.testing.assert_close(out, ref, **_tol(dtype), msg=lambda m: f"d={d} hq={hq} hkv={hkv} B={B} "
                                               f"splits={max_splits} one launch={tk is not None}: {m}")
                    assert not tickets.any()
                # A captured graph's plan: fixed capacities (unused entries, chunks past a group's own
                # count), loaded over a previous batch's contents.
                shape = CascadeShape.for_graph(B + 3, hq // hkv, 2)
                static = CascadePlan.empty(shape, B + 3, device)
                for gs in ([(max(groups[0][0] - 5, 1), groups[0][1][:2])], groups):
                    host = plan_cascade_host(gs, list(range(1, B + 1)), B, hkv, hq // hkv, shape)
                    assert host.fits(shape) and host.num_groups <= shape.max_groups
                    static.load(host, B)
                splits = num_kv_splits_for(seq_lens - static.kv_start[:B], 4, 8)
                out = cascade_decode_attention(q, k_buf, v_buf, r2t, req_idx, seq_lens, static, splits, 4, d ** -0.5,
                                               tickets=tickets if li else None)
                torch.testing.assert_close(out, ref, **_tol(dtype),
                                           msg=lambda m: f"graph plan d={d} hq={hq} hkv={hkv} B={B}: {m}")
                assert not tickets.any()


test_interpreted_cpu, test_cuda_bf16 = kernel_tests(globals())
