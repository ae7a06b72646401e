"""Paged decode attention (kernels/attention/triton_decode.py): split chunks merged by a second launch or
in one, 16-bit and FP8 pools, CUDA graphs."""
from __future__ import annotations

import pytest
import torch

from tests.kernels._helpers import _tol, _head_dims, _rand, _paged_setup, _decode_case
from tests.kernels._runner import kernel_tests


def check_attention_fp8_pool(device, dtype):
    """Decode (one and several splits, one- and two-launch merges), shared-prefix decode and extend attention over
    FP8 pools with per-layer scales equal the references that read the same pool (its rows times the scales);
    extend reads the new tokens' own k and v, unrounded."""
    from kernels.attention.triton_cascade import cascade_decode_attention, plan_cascade
    from kernels.attention.triton_decode import decode_attention, num_kv_splits_for
    from kernels.attention.triton_extend import extend_attention
    from kernels.reference import (cascade_decode_attention_ref, decode_attention_ref, extend_attention_ref,
                                   to_pool_ref)
    d, hq, hkv = _head_dims(device)[1], 8, 2
    ks, vs = 0.5, 1.7
    for pool in (torch.float8_e4m3fn, torch.float8_e5m2):
        lens = [1, 9, 70, 130]
        k_buf, v_buf, r2t, req_idx, seq = _paged_setup(device, torch.float32, hkv, d, [n - 1 for n in lens],
                                                       [1] * len(lens))
        kb, vb = to_pool_ref(k_buf, ks, pool), to_pool_ref(v_buf, vs, pool)
        seq_lens = torch.tensor(seq, dtype=torch.int32, device=device)
        q = _rand(len(lens), hq, d, dtype=dtype, device=device)
        ref = decode_attention_ref(q, kb, vb, r2t, req_idx, seq_lens, d ** -0.5, ks, vs)
        tickets = torch.zeros(len(lens) * hkv, dtype=torch.int32, device=device)
        # 32 chunks a request at most: stage 1 on four warps (two up to 16: triton_decode.stage1_tile).
        for max_splits, tk in [(1, None), (4, None), (4, tickets), (32, None), (32, tickets)]:
            splits = num_kv_splits_for(seq_lens, max_splits, 16)
            out = decode_attention(q, kb, vb, r2t, req_idx, seq_lens, splits, max_splits, d ** -0.5, tickets=tk,
                                   k_scale=ks, v_scale=vs)
            torch.testing.assert_close(out, ref, **_tol(dtype), msg=lambda m: f"{pool} splits={max_splits}: {m}")
        # A 16-bit query meets the FP8 tiles in float16 (pool_query); on the CPU too.
        qb = q.to(torch.bfloat16)
        refb = decode_attention_ref(qb, kb, vb, r2t, req_idx, seq_lens, d ** -0.5, ks, vs)
        out = decode_attention(qb, kb, vb, r2t, req_idx, seq_lens, num_kv_splits_for(seq_lens, 4, 16), 4, d ** -0.5,
                               tickets=tickets, k_scale=ks, v_scale=vs)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, refb, **_tol(torch.bfloat16), msg=lambda m: f"{pool} bf16 query: {m}")
        # Shared prefix: requests 1 and 3 share their first 9 slots.
        r2t[4, :9] = r2t[2, :9]
        groups = [(9, [1, 3])]
        ref = cascade_decode_attention_ref(q, kb, vb, r2t, req_idx, seq_lens, groups, d ** -0.5, ks, vs)
        torch.testing.assert_close(ref, decode_attention_ref(q, kb, vb, r2t, req_idx, seq_lens, d ** -0.5, ks, vs),
                                   **_tol(dtype))
        plan = plan_cascade(groups, [1, 2, 3, 4], len(lens), hkv, hq // hkv, device)
        splits = num_kv_splits_for(seq_lens - plan.kv_start, 4, 16)
        out = cascade_decode_attention(q, kb, vb, r2t, req_idx, seq_lens, plan, splits, 4, d ** -0.5,
                                       tickets=tickets, k_scale=ks, v_scale=vs)
        torch.testing.assert_close(out, ref, **_tol(dtype), msg=lambda m: f"{pool} cascade: {m}")
        # Extend over a cached prefix: the new tokens' k, v passed in the activation dtype.
        prefix, ext = [0, 40, 9], [7, 17, 5]
        k_buf, v_buf, r2t, req_idx, _ = _paged_setup(device, torch.float32, hkv, d, prefix, ext)
        kb, vb = to_pool_ref(k_buf, ks, pool), to_pool_ref(v_buf, vs, pool)
        T = sum(ext)
        slots = torch.cat([r2t[i + 1, p:p + e] for i, (p, e) in enumerate(zip(prefix, ext))]).long()
        k, v = k_buf[slots].to(dtype), v_buf[slots].to(dtype)
        q = _rand(T, hq, d, dtype=dtype, device=device)
        i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
        starts = i32([sum(ext[:i]) for i in range(len(ext))])
        ref = extend_attention_ref(q, kb, vb, r2t, req_idx, prefix, ext, d ** -0.5, ks, vs, k, v)
        out = extend_attention(q, k, v, kb, vb, r2t, req_idx, i32(prefix), i32(ext), starts, max(ext), d ** -0.5,
                               k_scale=ks, v_scale=vs)
        torch.testing.assert_close(out, ref, **_tol(dtype), msg=lambda m: f"{pool} extend: {m}")
        # The scales matter: without them the output differs.
        off = extend_attention(q, k, v, kb, vb, r2t, req_idx, i32(prefix), i32(ext), starts, max(ext), d ** -0.5)
        assert not torch.allclose(off, ref, **_tol(dtype))


def check_decode_attention(device, dtype):
    from kernels.attention.triton_decode import decode_attention, num_kv_splits_for
    from kernels.reference import decode_attention_ref
    lens = [1, 7, 33, 130]
    for d in _head_dims(device):
        for hq, hkv in [(4, 4), (4, 2), (8, 2)]:
            k_buf, v_buf, r2t, req_idx, seq = _paged_setup(device, dtype, hkv, d, [n - 1 for n in lens],
                                                           [1] * len(lens))
            seq_lens = torch.tensor(seq, dtype=torch.int32, device=device)
            q = _rand(len(lens), hq, d, dtype=dtype, device=device)
            ref = decode_attention_ref(q, k_buf, v_buf, r2t, req_idx, seq_lens, d ** -0.5)
            for max_splits, min_tok in [(1, 256), (4, 16), (8, 1)]:
                splits = num_kv_splits_for(seq_lens, max_splits, min_tok)
                out = decode_attention(q, k_buf, v_buf, r2t, req_idx, seq_lens, splits, max_splits, d ** -0.5)
                torch.testing.assert_close(out, ref, **_tol(dtype),
                                           msg=lambda m: f"d={d} hq={hq} hkv={hkv} splits={max_splits}: {m}")


def check_decode_attention_single_stage(device, dtype):
    """max_kv_splits == 1: one launch, no scratch, the same bits as the two-stage merge (forced here
    through a zero kv_start) and a zero output for a zero-length padding request."""
    from kernels.attention.triton_decode import decode_attention, num_kv_splits_for
    from kernels.reference import decode_attention_ref
    lens = [1, 7, 130, 0]
    for d in _head_dims(device)[:2]:
        for hq, hkv in [(4, 4), (8, 2)]:
            k_buf, v_buf, r2t, req_idx, _ = _paged_setup(device, dtype, hkv, d, [max(0, n - 1) for n in lens],
                                                         [min(1, n) for n in lens])
            seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
            q = _rand(len(lens), hq, d, dtype=dtype, device=device)
            splits = num_kv_splits_for(seq_lens, 1)
            out = decode_attention(q, k_buf, v_buf, r2t, req_idx, seq_lens, splits, 1, d ** -0.5)
            mid_o = torch.full((len(lens), hq, 1, d), float("nan"), device=device)
            mid_lse = torch.full((len(lens), hq, 1), float("nan"), device=device)
            two = decode_attention(q, k_buf, v_buf, r2t, req_idx, seq_lens, splits, 1, d ** -0.5, mid_o=mid_o,
                                   mid_lse=mid_lse, kv_start=torch.zeros_like(seq_lens))
            assert torch.equal(out, two), f"d={d} hq={hq} hkv={hkv}"
            assert torch.equal(out[3], torch.zeros_like(out[3]))
            ref = decode_attention_ref(q[:3], k_buf, v_buf, r2t, req_idx[:3], seq_lens[:3], d ** -0.5)
            torch.testing.assert_close(out[:3], ref, **_tol(dtype))


def check_decode_attention_one_launch(device, dtype):
    """Split decode merged by the last program of each (request, KV head) in the same launch: equal to the
    reference and to the two-launch merge, for batches with uneven per-request split counts (fewer than
    the grid's), contexts shorter than a chunk, a zero-length padding request, and scratch left full of
    NaN by a previous batch; the counters are back at zero after every call, so repeated calls agree."""
    from kernels.attention.triton_decode import decode_attention, num_kv_splits_for
    gen = torch.Generator().manual_seed(11)
    near = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)  # a bf16 ulp
    for lens, (hq, hkv), max_splits in [([1, 7, 33, 130, 0], (4, 2), 4), ([200], (8, 2), 16),
                                        ([65, 3, 129], (8, 1), 8)]:
        d = _head_dims(device)[len(lens) % 2]
        B = len(lens)
        k_buf, v_buf, r2t, req_idx, seq_lens, live, q, ref = _decode_case(device, dtype, lens, hq, hkv, d)
        tickets = torch.zeros(B * hkv + 5, dtype=torch.int32, device=device)
        mid_o = torch.empty((B, hq, max_splits, d), device=device)
        mid_lse = torch.full((B, hq, max_splits), float("nan"), device=device)
        # Per-request counts from the lengths (chunks of >= 16 tokens), and arbitrary ones (1..max_splits,
        # most below the grid's; many chunks of a short context empty).
        uneven = torch.randint(1, max_splits + 1, (B,), generator=gen, dtype=torch.int32).to(device)
        for splits in (num_kv_splits_for(seq_lens, max_splits, 16), uneven):
            two = decode_attention(q, k_buf, v_buf, r2t, req_idx, seq_lens, splits, max_splits, d ** -0.5)
            for call in range(2):
                mid_o.fill_(float("nan"))
                out = decode_attention(q, k_buf, v_buf, r2t, req_idx, seq_lens, splits, max_splits, d ** -0.5,
                                       mid_o=mid_o, mid_lse=mid_lse, tickets=tickets)
                what = f"lens={lens} hq={hq} hkv={hkv} d={d} splits={splits.tolist()} call {call}"
                assert not tickets.any(), f"{what}: counters left at {tickets.tolist()}"
                torch.testing.assert_close(out[live], ref, **_tol(dtype), msg=lambda m: f"{what}: {m}")
                torch.testing.assert_close(out, two, **near, msg=lambda m: f"{what}, against two launches: {m}")
                if len(live) < B:
                    assert torch.equal(out[lens.index(0)], torch.zeros_like(out[0])), what


def check_decode_attention_kv_before_wait(device, dtype):
    """Stage 1 with its chunk's first tile of k and v loaded before the PDL wait and the new token's row after
    it (KV_EARLY, unless some kernel family triggers early: kernels._utils.set_pdl): the same bits as without, one
    launch and two, a single stage, a shared prefix's kv_start, long chunks (more tiles than the first), empty chunks
    and a zero-length padding request; and the reference."""
    import kernels._utils as ku
    import kernels.attention.triton_decode as td
    for lens, (hq, hkv), max_splits, min_tok in [([1, 7, 33, 130, 0], (4, 2), 4, 16), ([200], (8, 2), 16, 1),
                                                 ([300, 65], (8, 1), 2, 64), ([150, 9], (4, 4), 1, 256)]:
        d = _head_dims(device)[len(lens) % 2]
        B = len(lens)
        k_buf, v_buf, r2t, req_idx, seq_lens, live, q, ref = _decode_case(device, dtype, lens, hq, hkv, d)
        splits = td.num_kv_splits_for(seq_lens, max_splits, min_tok)
        saved = ku._pdl_default, ku._pdl_early
        for how in ("one launch", "two launches", "kv_start"):
            outs = []
            for early in (False, True):
                ku.set_pdl(saved[0], "" if early else "gemv")
                try:
                    kw = {}
                    if how == "one launch":
                        kw = dict(tickets=torch.zeros(B * hkv, dtype=torch.int32, device=device))
                    elif how == "kv_start":  # no prefix partials (kv_start 0): the HAS_START kernel
                        kw = dict(kv_start=torch.zeros_like(seq_lens),
                                  mid_o=torch.empty((B, hq, max_splits + 1, d), device=device),
                                  mid_lse=torch.full((B, hq, max_splits + 1), float("-inf"), device=device))
                    outs.append(td.decode_attention(q, k_buf, v_buf, r2t, req_idx, seq_lens, splits, max_splits,
                                                    d ** -0.5, **kw))
                finally:
                    ku._pdl_default, ku._pdl_early = saved
            what = f"lens={lens} hq={hq} hkv={hkv} splits={splits.tolist()} {how}"
            assert torch.equal(outs[0], outs[1]), what
            torch.testing.assert_close(outs[1][live], ref, **_tol(dtype), msg=lambda m: f"{what}: {m}")


def check_decode_attention_tiles(device, dtype):
    """Stage 1 at other tiles than stage1_tile's (BLOCK_N 32 and 128, more warps and stages: a sweep's) matches the
    reference, in one launch (the ticket counters left zero) and two."""
    import kernels.attention.triton_decode as td
    for lens, (hq, hkv), max_splits, min_tok in [([1, 7, 33, 130, 0], (4, 2), 4, 16), ([300, 65], (8, 1), 2, 64),
                                                 ([150, 9, 270], (4, 4), 1, 256)]:
        d = _head_dims(device)[len(lens) % 2]
        B = len(lens)
        k_buf, v_buf, r2t, req_idx, seq_lens, live, q, ref = _decode_case(device, dtype, lens, hq, hkv, d)
        splits = td.num_kv_splits_for(seq_lens, max_splits, min_tok)
        for how in ("one launch", "two launches"):
            for tile in (None, (32, 4, 3), (128, 8, 2)):
                kw = dict(tickets=torch.zeros(B * hkv, dtype=torch.int32, device=device)) if how == "one launch" else {}
                out = td.decode_attention(q, k_buf, v_buf, r2t, req_idx, seq_lens, splits, max_splits, d ** -0.5,
                                          tile=tile, **kw)
                what = f"lens={lens} hq={hq} hkv={hkv} splits={splits.tolist()} {how} {tile}"
                if "tickets" in kw:
                    assert not kw["tickets"].any(), what
                torch.testing.assert_close(out[live], ref, **_tol(dtype), msg=lambda m: f"{what}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("one_launch", [False, True])
def test_cuda_graph_decode_replay_tracks_new_lengths(one_launch):
    """Capture decode attention (metadata included) once, then replay with longer contexts; with the
    one-launch merge the counters are back at zero after every replay (a replay finding them dirty
    would merge too early or never)."""
    from kernels.attention.triton_decode import decode_attention, num_kv_splits_for, plan_max_kv_splits
    from kernels.reference import decode_attention_ref
    dev, d, hq, hkv = torch.device("cuda"), 128, 32, 8
    k_buf, v_buf, r2t, req_idx, _ = _paged_setup(dev, torch.bfloat16, hkv, d, [900, 40, 3], [100, 1, 1],
                                                 num_slots=2000)
    seq = torch.tensor([10, 7, 1], dtype=torch.int32, device=dev)
    q = _rand(3, hq, d, dtype=torch.bfloat16, device=dev)
    ms = plan_max_kv_splits(3, hkv)
    assert ms > 1
    out = torch.empty_like(q)
    tickets = torch.zeros(3 * hkv, dtype=torch.int32, device=dev) if one_launch else None

    def call():
        decode_attention(q, k_buf, v_buf, r2t, req_idx, seq, num_kv_splits_for(seq, ms), ms, d ** -0.5, out=out,
                         tickets=tickets)
    call()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    for lens in ([10, 7, 1], [1000, 41, 4], [513, 2, 3], [1000, 1000, 64]):
        seq.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(_rand(3, hq, d, dtype=torch.bfloat16, device=dev))
        for _ in range(2):
            out.zero_()
            g.replay()
            ref = decode_attention_ref(q, k_buf, v_buf, r2t, req_idx, seq, d ** -0.5)
            torch.testing.assert_close(out, ref, **_tol(torch.bfloat16))
            assert tickets is None or not tickets.any()


@pytest.mark.gpu
def test_cuda_one_launch_decode_matches_two_launches_under_load():
    """Many programs finishing in any order (batch 1 to 64, up to 64 chunks each, shared-prefix columns
    too), each call repeated in one CUDA graph: the one-launch merge gives the two-launch output (within
    a bf16 ulp: the merges sum in other orders), every time, and leaves the counters at zero."""
    from kernels.attention.triton_cascade import cascade_decode_attention, plan_cascade
    from kernels.attention.triton_decode import decode_attention, num_kv_splits_for, plan_max_kv_splits
    dev, dt, d, hq, hkv = torch.device("cuda"), torch.bfloat16, 128, 32, 8
    gen = torch.Generator().manual_seed(17)
    for B in (1, 3, 64):
        lens = torch.randint(1, 4096, (B,), generator=gen).tolist()
        lens[:2] = [max(n, 400) for n in lens[:2]]  # room for the shared prefix below
        k_buf, v_buf, r2t, req_idx, _ = _paged_setup(dev, dt, hkv, d, [n - 1 for n in lens], [1] * B,
                                                     num_slots=sum(lens) + 16)
        seq = torch.tensor(lens, dtype=torch.int32, device=dev)
        q = _rand(B, hq, d, dtype=dt, device=dev)
        ms = plan_max_kv_splits(B, hkv)
        splits = num_kv_splits_for(seq, ms)
        tickets = torch.zeros(B * hkv, dtype=torch.int32, device=dev)
        two = decode_attention(q, k_buf, v_buf, r2t, req_idx, seq, splits, ms, d ** -0.5)
        outs = [torch.empty_like(q) for _ in range(8)]
        g = torch.cuda.CUDAGraph()
        decode_attention(q, k_buf, v_buf, r2t, req_idx, seq, splits, ms, d ** -0.5, tickets=tickets)
        with torch.cuda.graph(g):
            for o in outs:
                decode_attention(q, k_buf, v_buf, r2t, req_idx, seq, splits, ms, d ** -0.5, out=o, tickets=tickets)
        for _ in range(3):
            g.replay()
            for o in outs:
                torch.testing.assert_close(o, two, rtol=1e-2, atol=1e-2, msg=lambda m: f"B={B}: {m}")
                assert torch.equal(o, outs[0]), "the merge's result depends on which program was last"
            assert not tickets.any()
        if B >= 3:  # the first two requests share their first 300 slots (a radix-tree prefix)
            r2t[2, :300] = r2t[1, :300]
            plan = plan_cascade([(300, [0, 1])], req_idx.tolist(), B, hkv, hq // hkv, dev)
            splits = num_kv_splits_for(seq - plan.kv_start, ms)
            ref = cascade_decode_attention(q, k_buf, v_buf, r2t, req_idx, seq, plan, splits, ms, d ** -0.5)
            for _ in range(2):
                one = cascade_decode_attention(q, k_buf, v_buf, r2t, req_idx, seq, plan, splits, ms, d ** -0.5,
                                               tickets=tickets)
                torch.testing.assert_close(one, ref, rtol=1e-2, atol=1e-2)
                assert not tickets.any()


def test_decode_stage1_tile_over_an_fp8_pool_is_unpipelined(monkeypatch):
    """Stage 1 over an FP8 pool runs one pipeline stage (two were slower at the throughput workload's batch-256
    attention), on two warps up to 16 chunks a request and four past them (docs/kernels.md); a bf16 pool keeps
    (64, 4, 2) whatever the split."""
    import kernels.attention.triton_decode as td

    assert td.stage1_tile(128) == td.stage1_tile(128, max_kv_splits=32) == (64, 4, 2)
    assert td.stage1_tile(128, kv_fp8=True) == td.stage1_tile(128, True, 16) == (64, 2, 1)
    monkeypatch.setattr(td, "num_sms", lambda: 132)  # an H100's, as the plans of the measured batches had them
    assert [td.stage1_tile(128, True, td.plan_max_kv_splits(b, 8)) for b in (1, 8, 64, 256)] == \
        [(64, 4, 1), (64, 2, 1), (64, 2, 1), (64, 2, 1)]
    assert td.stage1_tile(256, kv_fp8=True) == (32, 2, 1)


test_interpreted_cpu, test_cuda_bf16 = kernel_tests(globals())
