"""The Triton attention backend end to end (shared/models/attention/triton_backend.py) and the factory."""
from __future__ import annotations

import os

import pytest
import torch

from tests.kernels._helpers import _tol, write_rows
from tests.kernels._runner import kernel_tests


def check_backend_end_to_end(device, dtype):
    """Extend two requests (one with a cached prefix), then decode two steps, through ForwardBatch,
    with the Triton and torch backends on identical pools: outputs and pool contents must agree. Also over
    FP8 pools with per-layer scales (--kv-cache-dtype fp8_e4m3)."""
    for pool_dtype, scales in ((dtype, None), (torch.float8_e4m3fn, [(0.5, 1.3), (1.0, 0.8)])):
        _backend_end_to_end(device, dtype, pool_dtype, scales)


def _backend_end_to_end(device, dtype, pool_dtype, scales):
    from shared.models.attention import create_attention_backend
    from shared.cache.kv_pool import KVPool, ReqToTokenPool
    from shared.models.forward_batch import ForwardBatch, ForwardMode
    hq, hkv, d, layers = 4, 2, 16, 2
    worlds = []
    # 1 split: the single-launch decode; one launch: split decode merged in stage 1's launch.
    for name, splits, one in (("torch", 4, False), ("triton", 4, False), ("triton", 1, False), ("triton", 4, True)):
        be = create_attention_backend(name, hq, hkv, d, device=device, max_kv_splits=splits, min_tokens_per_split=8,
                                      one_launch_decode=one)
        worlds.append((be, KVPool(layers, hkv, d, num_pages=64, page_size=4, dtype=pool_dtype, device=device,
                                  scales=scales), ReqToTokenPool(4, 128, device)))
    gen = torch.Generator().manual_seed(0)
    rows = [1, 2]
    steps = [(ForwardMode.EXTEND, [0, 0], [11, 5]), (ForwardMode.EXTEND, [11, 5], [20, 3]),
             (ForwardMode.DECODE, [31, 8], [1, 1]), (ForwardMode.DECODE, [32, 9], [1, 1])]
    next_slot = 4  # page 0 is reserved
    for mode, prefix, ext in steps:
        T = sum(ext)
        locs = torch.arange(next_slot, next_slot + T)
        next_slot += T
        q = torch.randn(T, hq * d, generator=gen).to(device, dtype)
        k = torch.randn(T, hkv * d, generator=gen).to(device, dtype)
        v = torch.randn(T, hkv * d, generator=gen).to(device, dtype)
        outs = []
        for be, pool, r2t in worlds:
            write_rows(r2t, rows, prefix, ext, locs, device)
            fb = ForwardBatch.build(mode, [0] * T, rows, prefix, ext, locs, r2t.req_to_token, pool, be, device)
            be.init_forward_metadata(fb)
            if mode == ForwardMode.DECODE and hasattr(be, "max_kv_splits"):  # the triton ones
                assert (be._meta.mid_o is None) == (be.max_kv_splits == 1)
                assert (be._meta.tickets is not None) == (be.one_launch_decode and be.max_kv_splits > 1)
            outs.append(torch.stack([be.forward(q, k, v, layer, fb) for layer in range(layers)]))
            if getattr(be, "_tickets", None) is not None:
                assert not be._tickets.any()
        for out in outs[1:]:
            torch.testing.assert_close(out, outs[0], **_tol(dtype),
                                       msg=lambda m: f"{pool_dtype} {mode} {prefix}: {m}")
    for layer in range(layers):
        for w in worlds[1:]:
            assert torch.equal(worlds[0][1].k_buffers[layer].float(), w[1].k_buffers[layer].float())
            assert torch.equal(worlds[0][1].v_buffers[layer].float(), w[1].v_buffers[layer].float())


def check_backend_extend_decode_tail(device, dtype):
    """An extend pass ending in one-token rows (mixed chunks' riders, catch-up riders): the Triton backend
    runs them with the decode kernel (split or not, merged in one launch or two) where that saves enough of
    the extend grid's empty programs; the same attention as the extend kernel for every row and as the
    torch backend."""
    import shared.models.attention.triton_backend as tb
    from shared.cache.kv_pool import KVPool, ReqToTokenPool
    from shared.models.forward_batch import ForwardBatch, ForwardMode
    from shared.models.attention import create_attention_backend
    hq, hkv, d = 4, 2, 16
    gen = torch.Generator().manual_seed(3)
    rows = [1, 2, 3, 4, 5, 6, 7]
    prefix = [0, 9, 30, 5, 17, 64, 1]
    ext = [37, 21, 1, 1, 1, 1, 1]  # two prompts, then five riders
    T = sum(ext)
    q = torch.randn(T, hq * d, generator=gen).to(device, dtype)
    k = torch.randn(T, hkv * d, generator=gen).to(device, dtype)
    v = torch.randn(T, hkv * d, generator=gen).to(device, dtype)
    cached = sum(prefix)
    ck = torch.randn(cached, hkv, d, generator=gen).to(device, dtype)
    cv = torch.randn(cached, hkv, d, generator=gen).to(device, dtype)
    outs = []
    saved = tb.DECODE_TAIL_MIN_EMPTY_PROGRAMS
    try:
        for name, min_empty, splits, one in (("torch", 0, 4, False), ("triton", 1 << 30, 4, False),
                                             ("triton", 0, 4, False), ("triton", 0, 4, True), ("triton", 0, 1, False)):
            tb.DECODE_TAIL_MIN_EMPTY_PROGRAMS = min_empty
            be = create_attention_backend(name, hq, hkv, d, device=device, max_kv_splits=splits,
                                          min_tokens_per_split=8, one_launch_decode=one)
            pool = KVPool(1, hkv, d, num_pages=64, page_size=4, dtype=dtype, device=device)
            r2t = ReqToTokenPool(8, 128, device)
            slot, c = 4, 0
            for row, p in zip(rows, prefix):  # the cached prefixes
                locs = torch.arange(slot, slot + p)
                pool.k_buffers[0][locs.to(device)] = ck[c:c + p]
                pool.v_buffers[0][locs.to(device)] = cv[c:c + p]
                r2t.write(row, 0, locs.to(device))
                slot, c = slot + p, c + p
            new = torch.arange(slot, slot + T)
            off = 0
            for row, p, e in zip(rows, prefix, ext):
                r2t.write(row, p, new[off:off + e].to(device))
                off += e
            fb = ForwardBatch.build(ForwardMode.EXTEND, [0] * T, rows, prefix, ext, new, r2t.req_to_token, pool, be,
                                    device)
            be.init_forward_metadata(fb)
            if name == "triton":
                assert (be._meta.tail is not None) == (min_empty == 0), min_empty
                if be._meta.tail is not None:
                    assert (be._meta.head, be._meta.head_tokens) == (2, 58)
            outs.append(be.forward(q, k, v, 0, fb))
            if getattr(be, "_tickets", None) is not None:
                assert not be._tickets.any()
    finally:
        tb.DECODE_TAIL_MIN_EMPTY_PROGRAMS = saved
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], **_tol(dtype))


def check_backend_cascade_decode(device, dtype):
    """A decode batch with prefix groups through the Triton backend equals the torch backend's plain
    decode on the same pool."""
    from shared.models.attention import create_attention_backend
    from shared.cache.kv_pool import KVPool, ReqToTokenPool
    from shared.models.forward_batch import ForwardBatch, ForwardMode
    hq, hkv, d = 8, 2, 16
    gen = torch.Generator().manual_seed(5)
    pool = KVPool(1, hkv, d, num_pages=256, page_size=1, dtype=dtype, device=device)
    pool.k_buffers[0].copy_(torch.randn(pool.k_buffers[0].shape, generator=gen))
    pool.v_buffers[0].copy_(torch.randn(pool.v_buffers[0].shape, generator=gen))
    r2t = ReqToTokenPool(6, 128, device)
    prefix = torch.arange(1, 41)
    lens = [45, 41, 60, 50, 7]
    nxt = 41
    for row, n in zip(range(1, 6), lens):
        own = torch.arange(nxt, nxt + n)
        nxt += n
        r2t.write(row, 0, torch.cat([prefix, own[40:]]) if row <= 4 else own)
    q = torch.randn(5, hq * d, generator=gen).to(device, dtype)
    outs = []
    # Plain (torch), eager shared-prefix, and the layout a captured graph of batch size 8 reads (the
    # planning and staging a CUDA-graph replay does, the forward run directly); the last two also with
    # the merge in the suffix kernel's launch.
    groups4 = [(40, [0, 1, 2, 3])]
    for name, groups, graph, one in (("torch", None, False, False), ("triton", groups4, False, False),
                                     ("triton", groups4, True, False), ("triton", groups4, False, True),
                                     ("triton", groups4, True, True)):
        be = create_attention_backend(name, hq, hkv, d, device=device,
                                      **({"max_kv_splits": 4, "one_launch_decode": one} if name == "triton" else {}))
        locs = torch.tensor([r2t.req_to_token[i + 1, n - 1].item() for i, n in enumerate(lens)])
        fb = ForwardBatch.build(ForwardMode.DECODE, [0] * 5, [1, 2, 3, 4, 5], [n - 1 for n in lens], [1] * 5, locs,
                                r2t.req_to_token, pool, be, device)
        fb.prefix_groups = groups
        if graph:
            assert be.graph_cascade() and be.plan_graph_cascade(5, groups, [1, 2, 3, 4, 5], 5) is None  # no graph yet
            be._graph_plan(8, device)  # what capturing the graphs of batch sizes 8 and 5 makes
            be._graph_plan(5, device)
            pairs = [(40, [0, 1]), (41, [2, 3]), (42, [4, 5])]  # 3 entries > 8 // min group 4
            assert be.plan_graph_cascade(8, pairs, list(range(1, 9)), 8) is None
            assert be.plan_graph_cascade(8, pairs[:2], list(range(1, 9)), 8) is not None
            plan = be.plan_graph_cascade(5, groups, [1, 2, 3, 4, 5], 5)
            be.load_graph_cascade(5, plan, 5)
            fb.prefix_groups, fb.graph_cascade = None, True
        be.init_forward_metadata(fb)
        if groups:
            assert be._meta.cascade is not None and (be._meta.tickets is not None) == one
        k = pool.k_buffers[0][locs.to(device)].reshape(5, hkv * d).clone()
        v = pool.v_buffers[0][locs.to(device)].reshape(5, hkv * d).clone()
        outs.append(be.forward(q, k, v, 0, fb))
        if one:
            assert not be._meta.tickets.any()
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], **_tol(dtype))


def check_backend_fallback(device, dtype):
    """Head sizes beyond the kernels' tiles run on the torch path instead of failing."""
    from shared.models.attention import create_attention_backend
    be = create_attention_backend("triton", 2, 1, 512, device=device)
    assert be.fallback is not None


def test_triton_backend_defaults_are_the_engines():
    """Direct users of the Triton backend (kernel tests, benches) get the decode attention the engine runs: the
    engine's config module does not import the kernels, so the two hold their defaults apart."""
    import inspect

    from kernels.attention.triton_decode import MAX_KV_SPLITS
    from shared.engine.config import EngineConfig
    from shared.models.attention.triton_backend import TritonAttentionBackend
    params = inspect.signature(TritonAttentionBackend.__init__).parameters
    assert params["max_kv_splits"].default == MAX_KV_SPLITS == EngineConfig.triton_attention_num_kv_splits
    assert params["one_launch_decode"].default is EngineConfig.one_launch_decode_attention is True


def test_factory_choices():
    from shared.models.attention import TorchAttentionBackend, create_attention_backend
    assert isinstance(create_attention_backend("auto", 4, 2, 16, device="cpu"), TorchAttentionBackend)
    with pytest.raises(ValueError, match="unknown attention backend 'nope'; choose one of auto, torch, triton, flashinfer"):
        create_attention_backend("nope", 4, 2, 16)
    with pytest.raises(ValueError, match="flashinfer attention backend needs a CUDA device"):
        create_attention_backend("flashinfer", 4, 2, 16)
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        with pytest.raises(ValueError, match="CUDA"):
            create_attention_backend("triton", 4, 2, 16, device="cpu")


test_interpreted_cpu, test_cuda_bf16 = kernel_tests(globals())
