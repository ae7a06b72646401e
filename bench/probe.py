"""Exploratory GPU probes (one device call each, a few minutes): where batch-1 decode and extend time goes.

    python -m bench.probe pdl        # a Llama-8B layer's four GEMVs x 32 in one CUDA graph, PDL off / on
    python -m bench.probe extend     # extend attention: our tiles, torch's flash varlen and SDPA backends
    python -m bench.probe trace      # the engine's batch-1 decode graph, kernel by kernel (torch.profiler)
    python -m bench.probe trace_pdl  # the same with PDL (kernels overlap, so spans, not per-kernel times)
    python -m bench.probe trace_pdl_b2  # batch 2's replay kernel by kernel beside batch 1's (what only batch 1 fuses)
    python -m bench.probe b1         # batch-1 step and replay, bf16 and FP8, engines with PDL off / on
    python -m bench.probe steps      # what the GPU runs between two batch-1 graph replays, host ops
    python -m bench.probe tput       # the throughput workload, prefill and decode against the roofline model
    python -m bench.probe b1phases   # batch-1 decode in the engine loop, host phases and device time per pass
    python -m bench.probe trace256   # the batch-256 decode graph of that workload, kernel by kernel
    python -m bench.probe trace_prefill  # its prefill passes (8k-token chunks, eager), kernel by kernel
    python -m bench.probe extend_pack    # extend attention, one query head per program vs a KV group's heads packed
    python -m bench.probe prefill_attn   # no-prefix prefill attention: our tiles vs cuDNN SDPA per sequence
    python -m bench.probe prefill_attn_tma  # the same with the new tokens' k/v by TMA or pointer loads; then in the engine
    python -m bench.probe tput_clocks  # SM clock, power and limit reasons during the throughput workload, by phase
    python -m bench.probe decode256  # decode attention at 256 x 640 tokens: splits x tiles x grid order, against the copy rate
    python -m bench.probe trace_prefill4k  # bench.offline's prefill passes (2 x 4096 tokens), kernel by kernel
    python -m bench.probe prefill_tiles  # bench.offline's prefill rate with the long-prompt extend tile varied in the engine
    python -m bench.probe extend_layout  # extend attention on the engine's qkv views vs contiguous, alone and after a GEMM
    python -m bench.probe fp8_small_m  # FP8 linears at 1..64 rows: bf16, W8A8 (_scaled_mm), weight-only on the GEMV's MMA
    python -m bench.probe bf16_small_m  # bf16 linears at 1..16 rows: cuBLAS against the GEMV's tensor-core tile, swept
    python -m bench.probe two_row_tiles  # the two-row kernel's tiles swept at 2 rows, then in the engine
    python -m bench.probe lm_head_rows  # the lm_head at 2..16 rows: cuBLAS against the GEMV, alone and in the engine
    python -m bench.probe fp8_batches  # decode steps at batch 1..64: bf16, FP8 at the defaults, FP8 W8A8 past one row
"""
from __future__ import annotations

import collections
import gc
import json
import os
import statistics
import sys
import time

import torch

from bench.common import GREEDY, b1_engine, drive, graph_replay_ms, model_dir, random_prompts
from bench.kernels import graph_time_ms

HQ, HKV, D, HIDDEN, INTER = 32, 8, 128, 4096, 14336
DT = torch.bfloat16


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def probe_pdl(res: dict) -> None:
    from kernels.gemv import gemv
    layers = 32
    dev = "cuda"
    ws = [(torch.randn(6144, HIDDEN, dtype=DT, device=dev) * 0.02, torch.randn(HIDDEN, HIDDEN, dtype=DT, device=dev) * 0.02,
           torch.randn(2 * INTER, HIDDEN, dtype=DT, device=dev) * 0.02, torch.randn(HIDDEN, INTER, dtype=DT, device=dev) * 0.02)
          for _ in range(layers)]
    x0 = torch.randn(1, HIDDEN, dtype=DT, device=dev)
    bufs = [torch.empty(1, 6144, dtype=DT, device=dev), torch.empty(1, HIDDEN, dtype=DT, device=dev),
            torch.empty(1, 2 * INTER, dtype=DT, device=dev), torch.empty(1, HIDDEN, dtype=DT, device=dev)]
    nbytes = sum(w.numel() * 2 for lw in ws for w in lw)

    def chain(pdl):
        def fn(i):
            x = x0
            for wq, wo, wgu, wd in ws:
                gemv(x, wq, out=bufs[0], pdl=pdl)
                gemv(bufs[0][:, :HIDDEN], wo, out=bufs[1], pdl=pdl)
                gemv(bufs[1], wgu, out=bufs[2], pdl=pdl)
                gemv(bufs[2], wd, out=bufs[3], silu_mul=True, pdl=pdl)
                x = bufs[3]
        return fn

    ref = None
    for pdl in (False, True, False, True):
        fn = chain(pdl)
        fn(0)
        torch.cuda.synchronize()
        out = bufs[3].clone()
        if ref is None:
            ref = out
        same = torch.equal(out, ref)
        t = graph_time_ms(fn, reps=9, target_ms=20)
        log(f"pdl={pdl}: 128 GEMVs {t * 1e3:.0f} us, {nbytes / t / 1e6:.0f} GB/s, same result {same}")
        res.setdefault("pdl", []).append({"pdl": pdl, "us": t * 1e3, "GBps": nbytes / t / 1e6, "same": same})
    del ws


def _packed_batch(B: int, L: int):
    """B requests of L new tokens each, no prefix, packed: q, k, v, a dummy pool and its table, the
    per-request tensors, cumulative lengths, the causal FLOPs and an output buffer."""
    T = B * L
    q = torch.randn(T, HQ, D, dtype=DT, device="cuda")
    k = torch.randn(T, HKV, D, dtype=DT, device="cuda")
    v = torch.randn(T, HKV, D, dtype=DT, device="cuda")
    kb = torch.zeros(16, HKV, D, dtype=DT, device="cuda")
    r2t = torch.zeros(B, 16, dtype=torch.int32, device="cuda")
    req = torch.arange(B, dtype=torch.int32, device="cuda")
    zero = torch.zeros(B, dtype=torch.int32, device="cuda")
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    starts = torch.arange(B, dtype=torch.int32, device="cuda") * L
    cu = torch.arange(B + 1, dtype=torch.int32, device="cuda") * L
    return q, k, v, kb, r2t, req, zero, lens, starts, cu, 4 * HQ * D * B * L * (L + 1) / 2, torch.empty_like(q)


def probe_extend(res: dict) -> None:
    from kernels.attention.triton_extend import extend_attention, extend_block_sizes
    rows = []
    for B, L in [(1, 8192), (2, 4096), (8, 1024)]:
        q, k, v, kb, r2t, req, zero, lens, starts, cu, flops, out = _packed_batch(B, L)
        base = None
        for cfg in [None, (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 4, 3),
                    (128, 32, 4, 3), (64, 128, 4, 2)]:
            try:
                t = graph_time_ms(lambda i: extend_attention(q, k, v, kb, kb, r2t, req, zero, lens, starts, L,
                                                             D ** -0.5, out=out, config=cfg), reps=7)
                if base is None:
                    base = out.clone()
                rows.append({"case": f"{B}x{L}", "impl": f"ours {cfg or extend_block_sizes(D, DT)}", "us": t * 1e3,
                             "TFLOPs": flops / t / 1e9})
            except Exception as e:
                rows.append({"case": f"{B}x{L}", "impl": f"ours {cfg}", "error": repr(e)[:200]})
            log(rows[-1])
        try:
            def fa(i):
                return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, L, L, 0.0, True, False,
                                                               scale=D ** -0.5)[0]
            o = fa(0)
            err = (o.float() - base.float()).abs().max().item()
            t = graph_time_ms(fa, reps=7)
            rows.append({"case": f"{B}x{L}", "impl": "aten flash varlen", "us": t * 1e3, "TFLOPs": flops / t / 1e9,
                         "max_err_vs_ours": err})
        except Exception as e:
            rows.append({"case": f"{B}x{L}", "impl": "aten flash varlen", "error": repr(e)[:300]})
        log(rows[-1])
        if B == 1:
            F = torch.nn.functional
            from torch.nn.attention import SDPBackend, sdpa_kernel
            qf, kf, vf = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            for name, be in [("default", None), ("flash", SDPBackend.FLASH_ATTENTION),
                             ("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:
                try:
                    def sd(i):
                        if be is None:
                            return F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, enable_gqa=True)
                        with sdpa_kernel([be]):
                            return F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, enable_gqa=True)
                    t = graph_time_ms(sd, reps=5)
                    rows.append({"case": f"{B}x{L}", "impl": f"SDPA {name}", "us": t * 1e3, "TFLOPs": flops / t / 1e9})
                except Exception as e:
                    rows.append({"case": f"{B}x{L}", "impl": f"SDPA {name}", "error": repr(e)[:200]})
                log(rows[-1])
        del q, k, v
        torch.cuda.empty_cache()
    res["extend"] = rows


def probe_extend_pack(res: dict) -> None:
    """Extend attention with one query head per program against a KV group's heads packed into the rows
    (kernels/attention/triton_extend.py), on prefixed short extends (jump-forward catch-up, chat turns)
    and on plain prefill; each case checks the packed output against the unpacked one."""
    from kernels.attention.triton_extend import extend_attention, extend_block_sizes, extend_pack
    rows = []
    cases = [(44, 300, 17), (64, 150, 4), (64, 40, 40), (32, 1000, 64), (8, 2000, 100), (16, 0, 512), (1, 0, 8192)]
    for B, P, E in cases:
        T, S = B * E, B * (P + E)
        q = torch.randn(T, HQ, D, dtype=DT, device="cuda")
        kb = torch.randn(S + 1, HKV, D, dtype=DT, device="cuda")
        vb = torch.randn(S + 1, HKV, D, dtype=DT, device="cuda")
        slots = (torch.randperm(S, device="cuda") + 1).to(torch.int32).view(B, P + E)
        r2t = torch.zeros(B, P + E, dtype=torch.int32, device="cuda")
        r2t[:] = slots
        new = slots[:, P:].reshape(-1).long()
        k, v = kb[new], vb[new]
        req = torch.arange(B, dtype=torch.int32, device="cuda")
        i32 = dict(dtype=torch.int32, device="cuda")
        pl, el = torch.full((B,), P, **i32), torch.full((B,), E, **i32)
        sl = torch.arange(B, **i32) * E
        flops = 4 * HQ * D * B * (E * P + E * (E + 1) / 2)
        out, ref = torch.empty_like(q), None
        auto = extend_pack(HQ, HKV)
        for pack, cfg in [(1, None), (4, None), (4, (128, 64, 8, 3)), (4, (64, 64, 4, 3)), (4, (128, 32, 4, 3)),
                          (4, (128, 64, 4, 3)), (4, (64, 32, 4, 2)), (2, None)]:
            name = f"pack {pack} {cfg or extend_block_sizes(D, DT, E * pack if pack > 1 else None)}"
            try:
                t = graph_time_ms(lambda i: extend_attention(q, k, v, kb, vb, r2t, req, pl, el, sl, E, D ** -0.5,
                                                             out=out, config=cfg, pack=pack), reps=7)
                err = None
                if ref is None:
                    ref = out.clone()
                else:
                    err = (out.float() - ref.float()).abs().max().item()
                rows.append({"case": f"{B}x({P}+{E})", "impl": name, "auto": pack == auto and cfg is None,
                             "us": t * 1e3, "TFLOPs": flops / t / 1e9, "max_err_vs_pack1": err})
            except Exception as e:
                rows.append({"case": f"{B}x({P}+{E})", "impl": name, "error": repr(e)[:200]})
            log(rows[-1])
        del q, kb, vb, k, v
        torch.cuda.empty_cache()
    res["extend_pack"] = rows


def _cudnn_row(q, k, v, out, B: int, L: int, flops: float, ref=None) -> dict:
    """cuDNN SDPA run sequence by sequence on views of _packed_batch's q/k/v, each output copied into the packed out
    (as the engine would call it: SDPA takes no ragged batch), timed in CUDA graphs; a result row (or its error)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    F = torch.nn.functional

    def cudnn(i):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            for b in range(B):
                sl = slice(b * L, (b + 1) * L)
                o = F.scaled_dot_product_attention(q[sl].transpose(0, 1)[None], k[sl].transpose(0, 1)[None],
                                                   v[sl].transpose(0, 1)[None], is_causal=True, enable_gqa=True,
                                                   scale=D ** -0.5)
                out[sl].copy_(o[0].transpose(0, 1))
    row = {"case": f"{B}x{L}", "impl": "cuDNN SDPA per sequence + copy"}
    try:
        t = graph_time_ms(cudnn, reps=7)
        row.update(us=t * 1e3, TFLOPs=flops / t / 1e9)
        if ref is not None:
            row["max_err"] = (out.float() - ref.float()).abs().max().item()
    except Exception as e:
        row["error"] = repr(e)[:300]
    return row


def _extend_sweep(cases, variants: dict) -> list[dict]:
    """No-prefix causal extend attention over _packed_batch(B, L) for each (B, L) of cases: each variant (name ->
    extend_attention keyword arguments) timed in CUDA graphs, its largest difference from the first variant's
    output, then cuDNN SDPA per sequence (_cudnn_row)."""
    from kernels.attention.triton_extend import extend_attention
    rows = []
    for B, L in cases:
        q, k, v, kb, r2t, req, zero, lens, starts, cu, flops, out = _packed_batch(B, L)
        ref = None
        for name, kw in variants.items():
            try:
                t = graph_time_ms(lambda i: extend_attention(q, k, v, kb, kb, r2t, req, zero, lens, starts, L,
                                                             D ** -0.5, out=out, **kw), reps=7)
                if ref is None:
                    ref = out.clone()
                rows.append({"case": f"{B}x{L}", "impl": name, "us": t * 1e3, "TFLOPs": flops / t / 1e9,
                             "max_err": (out.float() - ref.float()).abs().max().item()})
            except Exception as e:
                rows.append({"case": f"{B}x{L}", "impl": name, "error": repr(e)[:300]})
            log(rows[-1])
        rows.append(_cudnn_row(q, k, v, out, B, L, flops, ref))
        log(rows[-1])
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def probe_prefill_attn(res: dict) -> None:
    """No-prefix prefill attention, the prefill goal's open question: our packed kernel at larger tiles
    against cuDNN SDPA run per sequence on views of the packed q/k/v (as the engine would call it), and what
    cuDNN's first call at a new length costs (one plan per length unless lengths are bucketed)."""
    from kernels.attention.triton_extend import extend_block_sizes
    res["prefill_attn"] = _extend_sweep(
        [(1, 1024), (4, 1024), (1, 2048), (2, 4096), (1, 8192)],
        {f"ours packed {cfg or extend_block_sizes(D, DT, 4096)}": {"config": cfg}
         for cfg in [None, (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 4)]})


def probe_prefill_attn_tma(res: dict) -> None:
    """No-prefix prefill attention with the new tokens' k and v read by TMA (kernels.attention.triton_extend's
    NEW_KV_TMA) against the pointer loads, at the default and larger tiles, packed and one head per program, with
    cuDNN SDPA per sequence as the reference; then the prefill goal's workload in the engine, pointer loads against
    TMA at the default tile, alternated (inside a pass the inputs come cold). The first run (2026-12-06) also swept
    the whole-block loop warp-specialized (tl.range(warp_specialize=True), 8 warps only in Triton 3.6): no gain,
    removed."""
    import kernels.attention.triton_extend as te
    variants = [(None, None, False), (None, None, True), ((64, 64, 4, 2), None, True)]
    for cfg in [(128, 64, 8, 3), (128, 128, 8, 3)]:
        variants += [(cfg, None, False), (cfg, None, True)]
    variants += [((128, 128, 8, 3), 1, True)]  # one head per program, as FA's tutorial kernels run
    res["prefill_attn_tma"] = _extend_sweep(
        [(1, 8192), (2, 4096), (8, 1024)],
        {f"{cfg or 'default'} pack={pack or 'auto'} tma={int(tma)}": {"config": cfg, "pack": pack, "tma": tma}
         for cfg, pack, tma in variants})
    # The engine: bench.offline's prefill measurement (16 x 4096 tokens in 8k-token passes), pointer loads / TMA.
    knob = te.NEW_KV_TMA
    eng = _tput_engine()
    erows = []
    for tma in (False, True, False, True):
        te.NEW_KV_TMA = tma
        erows.append({"tma": tma, **_prefill_4k(eng)})
        log(erows[-1])
    te.NEW_KV_TMA = knob
    eng.stop()
    res["prefill_attn_tma_engine"] = erows


def probe_b1(res: dict) -> None:
    """Batch-1 decode with PDL off / on, alternating engines in one process: step wall time, graph replay,
    and the greedy tokens (must be the same)."""
    rows = []
    tokens = {}
    for quant in (None, "fp8"):
        for pdl in (False, True, False, True):
            eng = b1_engine(pdl, quant)
            st = drive(eng, random_prompts(1, 512, 400, 2), {**GREEDY, "max_new_tokens": 256})
            step = st.wall_s / max(1, st.steps) * 1e3
            replay = graph_replay_ms(eng.runner.graph_runner)
            toks = [t for o in st.outputs.values() for t in o.token_ids]
            same = tokens.setdefault(quant, toks) == toks
            rows.append({"quant": quant, "pdl": pdl, "step_ms": step, "replay_ms": replay, "same_tokens": same,
                         "n_tokens": len(toks)})
            log(rows[-1])
            eng.stop()
            del eng
            gc.collect()
            torch.cuda.empty_cache()
    res["b1"] = rows


def _catchup_engine(extend_graphs: bool = True):
    """An engine (graphs to batch 8, PDL) with 44 cached 300-token prompts: (engine, prompts). Each of
    them plus 17 new tokens is an extend pass like jump-forward's catch-up passes (a captured graph's
    unless extend_graphs is false)."""
    from shared.engine.config import EngineConfig
    from shared.engine.engine import Engine
    from shared.tokenizer import Tokenizer
    path = model_dir("llama-3.1-8b")
    ec = EngineConfig(model_path=path, load_format="dummy", max_context_len=4096, max_total_tokens=200_000,
                      max_running_requests=64, cuda_graph=True, cuda_graph_max_bs=8, enable_pdl=True,
                      cuda_graph_max_extend_tokens=2048 if extend_graphs else 0)
    eng = Engine(ec, Tokenizer.load(path), on_output=lambda o: None)
    prefixes = random_prompts(44, 300, 400, 7)
    drive(eng, prefixes, {**GREEDY, "max_new_tokens": 1})
    return eng, prefixes


def _catchup_rounds(eng, prefixes, seed0: int, n: int) -> None:
    """n rounds: every cached prompt plus 17 fresh tokens, one token sampled."""
    for r in range(n):
        tails = random_prompts(len(prefixes), 17, 400, seed0 + r)
        drive(eng, [p + t for p, t in zip(prefixes, tails)], {**GREEDY, "max_new_tokens": 1})


def probe_trace_extend(res: dict) -> None:
    """The eager_host probe's passes (44 requests, 17 new tokens each on a cached 300-token prefix) kernel
    by kernel: what the device does in a catch-up-like extend pass besides the GEMMs."""
    from torch.profiler import ProfilerActivity, profile

    eng, prefixes = _catchup_engine()
    _catchup_rounds(eng, prefixes, 100, 2)  # warm: every kernel of these shapes compiled
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _catchup_rounds(eng, prefixes, 200, 3)
    _kernel_table(res, "trace_extend", [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA],
                  3, "per round (one 748-token extend pass + one 44-row eager decode pass)")
    eng.stop()


def probe_eager_host(res: dict) -> None:
    """Host cost of an eager extend pass like jump-forward's catch-up passes (44 requests, 17 new tokens
    each on a cached 300-token prefix): the pass breakdown, then a cProfile of the same passes (which
    Python functions, Triton's launcher included, make up the host 'model' phase)."""
    import cProfile
    import io
    import pstats

    from bench.pass_breakdown import PassBreakdown, format_summary
    eng, prefixes = _catchup_engine(extend_graphs=False)
    _catchup_rounds(eng, prefixes, 100, 2)  # warm: every kernel of these shapes compiled
    bd = PassBreakdown(eng)
    try:
        _catchup_rounds(eng, prefixes, 200, 6)
    finally:
        bd.close()
    summary = bd.summary()
    print(format_summary(summary, "eager extend, 44 x 17 tokens on 300 cached"), flush=True)
    prof = cProfile.Profile()
    prof.enable()
    _catchup_rounds(eng, prefixes, 300, 6)
    prof.disable()
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    st.sort_stats("tottime").print_stats(40)
    st.sort_stats("cumulative").print_stats(45)
    text = out.getvalue()
    print(text[-12000:], flush=True)
    res["eager_host"] = {"summary": summary, "profile": text[:60000]}
    eng.stop()


def _probe_trace(res: dict, pdl: bool, key: str, bs: int = 1, **config) -> None:
    eng = b1_engine(pdl, **config)
    drive(eng, random_prompts(bs, 512, 400, 2), {**GREEDY, "max_new_tokens": 64})
    eng.runner.graph_runner.neutralize(bs)
    g = eng.runner.graph_runner.graphs[bs, False]
    for _ in range(20):
        g.replay()
    torch.cuda.synchronize()
    _trace_graph(res, g, key)
    eng.stop()


def probe_trace(res: dict) -> None:
    _probe_trace(res, False, "trace")


def probe_trace_pdl(res: dict) -> None:
    _probe_trace(res, True, "trace_pdl")


def probe_trace_pdl_b2(res: dict) -> None:
    """The batch-2 replay, kernel by kernel, beside batch 1's: what a second row costs where only batch 1 fuses the
    residual norms, rope and the gated MLP into its GEMVs (bf16 batch 2 at 1.13x batch 1's step, H100, 2026-12-06)."""
    _probe_trace(res, True, "trace_pdl_b2", bs=2)
    _probe_trace(res, True, "trace_pdl_b1")


def probe_trace_pdl_b2_fp8(res: dict) -> None:
    """probe_trace_pdl_b2 with FP8 weights (quantized at load, per row): batch 2's replay beside batch 1's."""
    _probe_trace(res, True, "trace_pdl_fp8_b2", bs=2, quantization="fp8")
    _probe_trace(res, True, "trace_pdl_fp8_b1", quantization="fp8")


def probe_trace_pdl_fp8(res: dict) -> None:
    _probe_trace(res, True, "trace_pdl_fp8", quantization="fp8")


def probe_trace_pdl_whole(res: dict) -> None:
    """The batch-1 replay with every residual norm its own kernel (--no-decode-norm-fusion)."""
    _probe_trace(res, True, "trace_pdl_whole", decode_norm_fusion=False)


def probe_trace_pdl_prefetch(res: dict) -> None:
    """The batch-1 replay with each o_proj weight prefetched into L2 beside rope and attention (--decode-l2-prefetch)."""
    _probe_trace(res, True, "trace_pdl_prefetch", decode_l2_prefetch=True)


def probe_trace_pdl_rope(res: dict) -> None:
    """The batch-1 replay with rope and the KV store in the qkv GEMV's epilogue (--decode-rope-fusion)."""
    _probe_trace(res, True, "trace_pdl_rope", decode_rope_fusion=True)


def probe_trace_pdl_kv(res: dict) -> None:
    """The batch-1 replay with decode attention's first k/v tile loaded before its PDL wait."""
    import kernels.attention.triton_decode as td
    saved, td.KV_BEFORE_WAIT = td.KV_BEFORE_WAIT, True
    try:
        _probe_trace(res, True, "trace_pdl_kv")
    finally:
        td.KV_BEFORE_WAIT = saved


def probe_trace_pdl_early(res: dict) -> None:
    """The same with the decode-attention stages letting o_proj launch before they wait."""
    _probe_trace(res, True, "trace_pdl_early", pdl_early_trigger="attention")


def _tput_engine(**extra):
    """The throughput workload's engine (batch 256, 8k-token prefill chunks, graphs to batch 256)."""
    from shared.engine.config import EngineConfig
    from shared.engine.engine import Engine
    from shared.tokenizer import Tokenizer
    path = model_dir("llama-3.1-8b")
    ec = EngineConfig(model_path=path, load_format="dummy", max_context_len=8192, max_running_requests=256,
                      chunked_prefill_size=8192, max_prefill_tokens=8192, cuda_graph=True, **extra)
    eng = Engine(ec, Tokenizer.load(path), on_output=lambda o: None)
    drive(eng, random_prompts(8, 64, 400, 0), {**GREEDY, "max_new_tokens": 8})
    return eng


def _tput_alternated(variants: dict, key: str, rounds: int = 2, reps: int = 2) -> list[dict]:
    """The throughput workload (256 x (512, 128), bench.offline's engine settings) on each variant, {name: (engine
    fields, {"package.module.NAME": value} set while its engine is built and runs)}: a fresh engine per variant and
    round (graphs keep the kernels they were captured with), a warm run, then `reps` timed runs; the variants
    alternated `rounds` times. Logs each variant's median; returns the runs."""
    from bench.b1 import module_knobs
    out = []
    for rnd in range(rounds):
        for name, (fields, knobs) in variants.items():
            with module_knobs(knobs):
                eng = _tput_engine(**fields)
                drive(eng, random_prompts(256, 512, 400, 5), {**GREEDY, "max_new_tokens": 128})
                for rep in range(reps):
                    st = drive(eng, random_prompts(256, 512, 400, 6 + rep), {**GREEDY, "max_new_tokens": 128})
                    out.append({"variant": name, "round": rnd, "tok_s": 256 * 128 / st.wall_s, "wall_s": st.wall_s,
                                "pool_tokens": eng.runner.max_total_tokens})
                    log(out[-1])
                eng.stop()
            del eng
            gc.collect()  # the engine sits in reference cycles: free its KV pool before the next one's
            torch.cuda.empty_cache()
    for name in variants:
        vals = [r["tok_s"] for r in out if r["variant"] == name]
        log(f"{key} {name}: median {statistics.median(vals):.0f} tok/s of {[round(v) for v in vals]}")
    return out


def probe_b1phases(res: dict) -> None:
    """Batch-1 decode through the engine loop with bench/pass_breakdown's per-pass phases (host ms by
    phase, device ms per pass): whether the ~0.2 ms between a graph replay and an engine step is host work
    on the critical path or device work outside the graph."""
    eng = b1_engine(True)
    drive(eng, random_prompts(1, 512, 400, 2), {**GREEDY, "max_new_tokens": 32})
    st, summary = _broken_down(eng, random_prompts(1, 512, 400, 3), 256, "batch-1 decode")
    res["b1phases"] = {"summary": summary, "step_ms": st.wall_s / max(1, st.steps) * 1e3,
                       "replay_ms": graph_replay_ms(eng.runner.graph_runner)}
    log(f"b1phases: step {res['b1phases']['step_ms']:.3f} ms, replay {res['b1phases']['replay_ms']:.3f} ms")
    eng.stop()


def _broken_down(eng, prompts, max_new_tokens: int, title: str):
    """drive() under bench.pass_breakdown; prints the per-pass table, returns (RunStats, summary)."""
    from bench.pass_breakdown import PassBreakdown, format_summary
    bd = PassBreakdown(eng)
    try:
        st = drive(eng, prompts, {**GREEDY, "max_new_tokens": max_new_tokens})
    finally:
        bd.close()
    summary = bd.summary()
    summary["all"]["run_wall_s"] = st.wall_s
    print(format_summary(summary, f"{title}, {st.wall_s:.2f} s"), flush=True)
    return st, summary


def probe_tput_breakdown(res: dict) -> None:
    """The throughput workload free-running under bench.pass_breakdown: per pass kind, host time by phase
    against the pass's device time, so a batch-256 decode step shows whether the host keeps ahead."""
    eng = _tput_engine()
    drive(eng, random_prompts(256, 512, 400, 4), {**GREEDY, "max_new_tokens": 16})
    _, res["tput_breakdown"] = _broken_down(eng, random_prompts(256, 512, 400, 5), 128, "256 x (512, 128)")
    eng.stop()


def probe_trace256(res: dict, kv_cache_dtype: str = "auto") -> None:
    """The batch-256 decode graph kernel by kernel with 256 live rows at ~640 tokens of context (the throughput
    workload's late steps). Until 2026-12-05 this traced the graph after the workload had ended, whose last
    step held only the last admission round's 16 requests (the other 240 rows padding, one token of context
    each): its GEMMs were the batch-256 ones, its attention was not. kv_cache_dtype: the pool's (trace256_kvfp8
    traces an FP8 pool's, under keys of that name)."""
    from shared.engine.forward_batch import ForwardMode
    key = "trace256" if kv_cache_dtype == "auto" else "trace256_kvfp8"
    eng = _tput_engine(kv_cache_dtype=kv_cache_dtype)
    live: list[int] = []
    launch = eng.runner.launch

    def count(batch):
        if batch.mode == ForwardMode.DECODE:
            live.append(batch.batch_size)
        return launch(batch)
    eng.runner.launch = count
    eng.on_output = lambda outs: None
    from shared.protocol import GenerateRequest
    from shared.sampling_params import SamplingParams
    for i, p in enumerate(random_prompts(256, 512, 400, 5)):
        eng.submit(GenerateRequest(rid=f"t256-{i}", input_ids=p, sampling=SamplingParams(**GREEDY, max_new_tokens=256),
                                   stream=False))
    while sum(1 for b in live if b == 256) < 128:  # ~128 steps at batch 256: contexts ~512 + 128..143
        eng.step()
    eng.runner.launch = launch
    eng.step()  # the pass in flight resolves; its graph's inputs are a full batch's
    torch.cuda.synchronize()
    gr = eng.runner.graph_runner
    from kernels.decode_inputs import SEQ
    res[f"{key}_live_rows"] = int((gr.staged[:256, SEQ] > 1).sum())  # padding rows hold 1
    res[f"{key}_mean_context"] = float(gr.staged[:256, SEQ].float().mean())
    gr.neutralize(256)
    g = gr.graphs[256, False]
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    _trace_graph(res, g, key, reps=5)
    eng.stop()


def probe_decode256(res: dict) -> None:
    """Decode attention at the throughput workload's late steps (256 rows x 640 tokens, Llama-8B heads), alone in
    CUDA graphs with the KV out of L2, against the copy rate: 1 to 4 splits a request (the one-launch merge where
    split) x stage 1's tiles (BLOCK_N, warps, stages), then the best few with the grid head-major. Where the
    batch-256 step's half (trace256: 0.77 of copy bandwidth with one split at the default tile) can go."""
    from bench.kernels import D, HKV, HQ, DT, _pool, copies_for, graph_time_ms
    from bench.common import measure_copy_bandwidth
    from kernels.attention.triton_decode import decode_attention, num_kv_splits_for, stage1_tile
    B, ctx = 256, 640
    kv_bytes = 2 * B * ctx * HKV * D * 2
    kbs, vbs, r2t, req = _pool(B, ctx, copies_for(kv_bytes))
    seq = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(B, HQ, D, dtype=DT, device="cuda")
    out = torch.empty_like(q)
    n = len(kbs)
    bw = measure_copy_bandwidth()
    default = stage1_tile(D)
    tiles = [default] + [(bn, w, st) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)
                         if (bn, w, st) != default]
    rows = []

    def run(ms, tile, head_major):
        splits = num_kv_splits_for(seq, ms)
        mid_o = torch.empty(B, HQ, ms, D, dtype=torch.float32, device="cuda") if ms > 1 else None
        mid_lse = torch.empty(B, HQ, ms, dtype=torch.float32, device="cuda") if ms > 1 else None
        tickets = torch.zeros(B * HKV, dtype=torch.int32, device="cuda") if ms > 1 else None
        try:
            t = graph_time_ms(lambda i: decode_attention(q, kbs[i % n], vbs[i % n], r2t, req, seq, splits, ms,
                                                         D ** -0.5, out=out, mid_o=mid_o, mid_lse=mid_lse,
                                                         tickets=tickets, tile=tile, head_major=head_major))
        except Exception as e:  # a tile that does not fit (shared memory) is skipped, not fatal
            log(f"splits {ms} tile {tile} head_major {head_major}: {type(e).__name__}: {str(e)[:120]}")
            return
        rows.append({"max_kv_splits": ms, "tile": list(tile), "head_major": head_major, "us": t * 1e3,
                     "TBps": kv_bytes / t / 1e9, "of_copy": kv_bytes / t * 1e3 / bw})
        log(rows[-1])

    for ms in (1, 2, 4):
        for tile in tiles:
            run(ms, tile, False)
    best = sorted(rows, key=lambda r: r["us"])[:4]
    for r in best:
        run(r["max_kv_splits"], tuple(r["tile"]), True)
    run(1, default, False)  # the default again, last: drift over the sweep
    top = sorted(rows, key=lambda r: r["us"])[:8]
    for r in top:
        log(f"top: {r}")
    res["decode256"] = {"rows": rows, "copy_GBps": bw / 1e9, "kv_bytes": kv_bytes, "default_tile": list(default)}


def probe_decode256_layout(res: dict) -> None:
    """Decode attention alone at the throughput workload's late steps (256 rows x 640 tokens, the default tile and
    plan) over the pool orders the engine leaves (bench.kernels.slot_layout): each request's tokens in one run (how
    decode256 and bench.kernels time it: 188 us on the H200, 12-05), 512 prompt tokens in a run and 128 decode
    tokens a step apart (page size 1, as the workload runs: 210 us a layer inside the step), those in pages of 16
    of their own (--page-size 16), every token at a random slot. Whether the slot order is the 12% between them."""
    from bench.common import measure_copy_bandwidth
    from bench.kernels import D, HKV, HQ, DT, _pool, copies_for
    from kernels.attention.triton_decode import decode_attention, num_kv_splits_for, plan_max_kv_splits
    B, ctx, dec = 256, 640, 128
    kv_bytes = 2 * B * ctx * HKV * D * 2
    bw = measure_copy_bandwidth()
    ms = plan_max_kv_splits(B, HKV)
    seq = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    splits = num_kv_splits_for(seq, ms)
    q = torch.randn(B, HQ, D, dtype=DT, device="cuda")
    out = torch.empty_like(q)
    mid_o = torch.empty(B, HQ, ms, D, dtype=torch.float32, device="cuda")
    mid_lse = torch.empty(B, HQ, ms, dtype=torch.float32, device="cuda")
    rows = []
    for layout in ("contiguous", "engine", "paged", "shuffled", "contiguous"):  # the first again last: drift
        kbs, vbs, r2t, req = _pool(B, ctx, copies_for(kv_bytes), layout, dec)
        n = len(kbs)
        t = graph_time_ms(lambda i: decode_attention(q, kbs[i % n], vbs[i % n], r2t, req, seq, splits, ms, D ** -0.5,
                                                     out=out, mid_o=mid_o, mid_lse=mid_lse))
        rows.append({"layout": layout, "us": t * 1e3, "of_copy": kv_bytes / t * 1e3 / bw})
        log(f"decode256_layout {layout}: {rows[-1]['us']:.1f} us, {rows[-1]['of_copy']:.3f} of copy")
        del kbs, vbs
        torch.cuda.empty_cache()
    res["decode256_layout"] = {"rows": rows, "copy_GBps": bw / 1e9, "kv_bytes": kv_bytes, "max_kv_splits": ms}


def probe_tput_page(res: dict) -> None:
    """The throughput workload at page size 1 (the default, SGLang's) against 16 (a request's decode tokens in runs
    of its own; the radix tree then matches whole pages): the engine side of decode256_layout."""
    res["tput_page"] = _tput_alternated({"page 1": ({}, {}), "page 16": ({"page_size": 16}, {})}, "tput_page")


def probe_decode256_ab(res: dict) -> None:
    """The throughput workload (256 x (512, 128), bench.offline's engine settings) with decode attention at its
    defaults against decode256's fastest configuration (tile, splits at batch 256 through PROGRAMS_PER_SM, grid
    order; the default when decode256 did not run first), a fresh engine per run (graphs keep the tile they were
    captured with), alternated twice: whether the kernel's gain reaches the workload."""
    import kernels.attention.triton_decode as td
    from bench.b1 import module_knobs
    from kernels._utils import num_sms
    rows = res.get("decode256", {}).get("rows") or []
    best = min(rows, key=lambda r: r["us"]) if rows else None

    def dotted(kn: dict) -> dict:
        return {f"kernels.attention.triton_decode.{k}": v for k, v in kn.items()}
    variants = {"default": {"STAGE1_TILE": None, "PROGRAMS_PER_SM": 4, "HEAD_MAJOR": False}}
    if best is not None:
        # s splits at batch 256 with 8 KV heads: plan_max_kv_splits rounds PROGRAMS_PER_SM * SMs / 2048 up to a
        # power of two, so PROGRAMS_PER_SM = floor(s * 2048 / SMs) plans s (checked here)
        pps = 4 if best["max_kv_splits"] == 1 else best["max_kv_splits"] * 256 * HKV // num_sms()
        variants["best"] = {"STAGE1_TILE": tuple(best["tile"]), "PROGRAMS_PER_SM": pps,
                            "HEAD_MAJOR": best["head_major"]}
        with module_knobs(dotted(variants["best"])):
            assert td.plan_max_kv_splits(256, HKV) == best["max_kv_splits"], best
    out = _tput_alternated({name: ({}, dotted(kn)) for name, kn in variants.items()}, "decode256_ab")
    for r in out:
        r["knobs"] = variants[r["variant"]]
    res["decode256_ab"] = out


def probe_kvfp8(res: dict) -> None:
    """--kv-cache-dtype fp8_e4m3 against the model's bf16: kvfp8_kernel, then kvfp8_tput."""
    probe_kvfp8_kernel(res)
    probe_kvfp8_tput(res)


def _decode_attention_rows(shapes: list, variants) -> tuple[list, float]:
    """Decode attention alone at each (batch, context) of `shapes`, in CUDA graphs with the KV out of L2, for each
    variant of variants(batch): (pool name, stage-1 tile or None for the default, STAGE1_MIN_ROWS, EVEN_D_MASK).
    Rows of µs a call and the share of the copy rate the variant's own bytes move at; the copy rate in bytes/s."""
    from bench.common import measure_copy_bandwidth
    from bench.kernels import D, DT, _pool, copies_for
    import kernels.attention.triton_decode as td
    from kernels.attention.triton_decode import decode_attention, num_kv_splits_for, plan_max_kv_splits
    dtypes = {"bf16": DT, "fp8_e4m3": torch.float8_e4m3fn}
    bw = measure_copy_bandwidth()
    rows = []
    for B, ctx in shapes:
        kv_bytes = 2 * B * ctx * HKV * D * 2
        kbs, vbs, r2t, req = _pool(B, ctx, copies_for(kv_bytes))
        seq = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
        q = torch.randn(B, HQ, D, dtype=DT, device="cuda")
        out = torch.empty_like(q)
        ms = plan_max_kv_splits(B, HKV)
        splits = num_kv_splits_for(seq, ms)
        mid_o = torch.empty(B, HQ, ms, D, dtype=torch.float32, device="cuda") if ms > 1 else None
        mid_lse = torch.empty(B, HQ, ms, dtype=torch.float32, device="cuda") if ms > 1 else None
        tickets = torch.zeros(B * HKV, dtype=torch.int32, device="cuda") if ms > 1 else None
        pools = {}
        for name, tile, min_rows, even in variants(B):
            if name not in pools:
                pools.clear()
                torch.cuda.empty_cache()
                pools[name] = ([k.to(dtypes[name]) for k in kbs], [v.to(dtypes[name]) for v in vbs])
            ks, vs = pools[name]
            n = len(ks)
            td.STAGE1_MIN_ROWS, td.EVEN_D_MASK = min_rows, even
            try:
                t = graph_time_ms(lambda i: decode_attention(q, ks[i % n], vs[i % n], r2t, req, seq, splits, ms,
                                                             D ** -0.5, out=out, mid_o=mid_o, mid_lse=mid_lse,
                                                             tickets=tickets, tile=tile))
            except Exception as e:  # a tile that does not fit (shared memory) is skipped, not fatal
                log(f"{name} tile {tile} rows {min_rows}: {type(e).__name__}: {str(e)[:120]}")
                continue
            finally:
                td.STAGE1_MIN_ROWS, td.EVEN_D_MASK = 16, False
            nbytes = kv_bytes // (2 // dtypes[name].itemsize)
            rows.append({"batch": B, "ctx": ctx, "kv": name, "tile": list(tile) if tile else "default",
                         "min_rows": min_rows, "even_d": even, "us": t * 1e3, "of_copy": nbytes / t * 1e3 / bw})
            log(rows[-1])
        pools.clear()
        del kbs, vbs
        torch.cuda.empty_cache()
    return rows, bw


def probe_kvfp8_kernel(res: dict) -> None:
    """Decode attention alone over a bf16 and an FP8 pool at the throughput workload's late steps (256 rows x 640
    tokens) and at batch 1 / 64 with long contexts, each at its own bytes against the copy rate; the FP8 pool also at
    bf16's tile (two pipeline stages, its default before 2026-12-05); at 256 x 640 also without the head-dim mask
    (EVEN_D_MASK), and over the FP8 pool stage 1's tiles and 64-row query tiles (STAGE1_MIN_ROWS)."""
    def variants(B):
        out = [("bf16", None, 16, False)] + ([("bf16", None, 16, True)] if B == 256 else [])
        out += [("fp8_e4m3", None, 16, False), ("fp8_e4m3", (64, 4, 2), 16, False)]
        if B == 256:
            # FP8 tiles cost ~3x bf16's SASS instructions a byte (the 8-bit tile reaches the MMA through shared
            # memory without ldmatrix; bench.sm90_compile): stage 1's tiles over the FP8 pool. min_rows 64: Hopper's
            # warpgroup MMA, no byte transpose of V (triton_decode.STAGE1_MIN_ROWS).
            out += [("fp8_e4m3", None, 16, True)] + [
                ("fp8_e4m3", tile, rows, even) for tile, rows, even in
                [((64, 8, 1), 16, False), ((64, 8, 2), 16, False), ((128, 8, 1), 16, False), ((128, 8, 2), 16, False),
                 ((32, 4, 2), 16, False), ((64, 4, 2), 64, False), ((64, 4, 2), 64, True), ((128, 4, 2), 64, True),
                 ((64, 4, 3), 64, True)]]
        return out
    rows, bw = _decode_attention_rows([(256, 640), (1, 8192), (64, 1024)], variants)
    res["kvfp8_kernel"] = {"rows": rows, "copy_GBps": bw / 1e9}


def probe_kvfp8_tiles(res: dict) -> None:
    """Stage 1 over an FP8 pool without software pipelining (its default since 2026-12-05: (64, 4, 1), 16-row query
    tiles): block sizes, warps, 64-row query tiles and the mask-free head dim, at 256 x 640 and 64 x 1k, beside the
    bf16 pool and the FP8 default, each timed twice (first and last)."""
    sweep = [((64, 4, 1), 16, True), ((64, 4, 1), 64, False), ((64, 4, 1), 64, True), ((32, 4, 1), 16, False),
             ((32, 2, 1), 16, False), ((64, 2, 1), 16, False), ((128, 4, 1), 16, False), ((128, 8, 1), 16, True),
             ((64, 8, 1), 16, True), ((32, 4, 1), 16, True)]
    rows, bw = _decode_attention_rows(
        [(256, 640), (64, 1024)],
        lambda B: [("bf16", None, 16, False), ("fp8_e4m3", None, 16, False)]
        + [("fp8_e4m3", tile, r, even) for tile, r, even in sweep] + [("fp8_e4m3", None, 16, False)])
    res["kvfp8_tiles"] = {"rows": rows, "copy_GBps": bw / 1e9}


def probe_kvfp8_tput(res: dict) -> None:
    """The throughput workload (256 x (512, 128), bench.offline's engine settings) with a bf16 and an FP8 pool, fresh
    engines alternated twice, two runs each, with the pool each gets from the same memory fraction; the FP8 pool also
    at its decode-attention tile before the two-warp one (one stage, four warps; H100, 2026-12-05: 6,682 tok/s against
    6,769 for two warps and 6,535 for a bf16 pool)."""
    tile = "kernels.attention.triton_decode.STAGE1_TILE"  # read at capture: the engine's graphs keep it
    variants = {"auto": ({"kv_cache_dtype": "auto"}, {}), "fp8_e4m3": ({"kv_cache_dtype": "fp8_e4m3"}, {}),
                "fp8_e4m3 4 warps": ({"kv_cache_dtype": "fp8_e4m3"}, {tile: (64, 4, 1)})}
    out_runs = _tput_alternated(variants, "kvfp8")
    for r in out_runs:
        r["kv"] = r["variant"]
    res["kvfp8_tput"] = out_runs


def probe_tput_clocks(res: dict) -> None:
    """The GPU's SM clock, power draw and clock-limit reasons (nvidia-smi sampled every 50 ms) while the throughput
    workload runs (256 x (512, 128), bench.offline's engine settings, three runs after a warm one), split by the
    mode of the pass last launched (prefill or decode), and during the matmul reference's burst: whether the
    workload's device time is set by power-limited clocks (the 12-02 finding: decode passes 12.3 ms free-running
    against 10.4 replayed cool)."""
    import bisect
    import datetime
    import subprocess
    import tempfile
    from bench.common import measure_matmul_tflops
    fd, path = tempfile.mkstemp(suffix=".csv")
    os.close(fd)
    known = subprocess.run(["nvidia-smi", "--help-query-gpu"], capture_output=True, text=True).stdout
    reason = "clocks_event_reasons.active" if "clocks_event_reasons.active" in known else "clocks_throttle_reasons.active"
    fields = f"timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,{reason}"
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-lms", "50",
                            "-f", path])
    marks = []  # (time, phase)

    def mark(phase):
        torch.cuda.synchronize()
        marks.append((datetime.datetime.now(), phase))
    try:
        time.sleep(1.0)
        mark("idle")
        time.sleep(1.0)
        mark("matmul")
        tf = [measure_matmul_tflops() for _ in range(3)]
        mark("idle")
        eng = _tput_engine()
        launch = eng.runner.launch

        def timed_launch(batch):
            marks.append((datetime.datetime.now(), "prefill" if batch.mode.name == "EXTEND" else "decode"))
            return launch(batch)
        drive(eng, random_prompts(256, 512, 400, 5), {**GREEDY, "max_new_tokens": 128})
        walls = []
        eng.runner.launch = timed_launch
        for rep in range(3):
            st = drive(eng, random_prompts(256, 512, 400, 6 + rep), {**GREEDY, "max_new_tokens": 128})
            walls.append(st.wall_s)
        eng.runner.launch = launch
        mark("idle")
        time.sleep(1.0)
        eng.stop()
    finally:
        smi.terminate()
        smi.wait()
    samples = []
    for line in open(path):
        parts = [x.strip() for x in line.split(",")]
        try:
            t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f")
            samples.append((t, float(parts[1]), float(parts[2]), float(parts[3]), float(parts[4]), parts[5]))
        except (ValueError, IndexError):
            continue
    os.unlink(path)
    by = collections.defaultdict(list)
    mark_times = [mt for mt, _ in marks]
    for t, *vals in samples:
        i = bisect.bisect_right(mark_times, t)  # the phase of the latest mark at or before the sample
        if i:
            by[marks[i - 1][1]].append(vals)
    out = {"tflops": tf, "tput_tok_s": [256 * 128 / w for w in walls], "phases": {}}
    for ph, vals in by.items():
        reasons = collections.Counter(v[4] for v in vals)
        out["phases"][ph] = {"samples": len(vals), "sm_mhz": statistics.median(v[0] for v in vals),
                             "mem_mhz": statistics.median(v[1] for v in vals),
                             "power_w": statistics.median(v[2] for v in vals),
                             "temp_c": max(v[3] for v in vals), "reasons": dict(reasons.most_common(4))}
        log(f"tput_clocks {ph}: {out['phases'][ph]}")
    log(f"tput_clocks matmul {[round(x) for x in tf]} TFLOP/s, workload {[round(x) for x in out['tput_tok_s']]} tok/s")
    res["tput_clocks"] = out


def probe_mixed_first(res: dict) -> None:
    """--enable-mixed-chunk's first runs in a fresh engine (its warm-up now runs mixed passes): the throughput
    workload three times, each run's tok/s and the kernels Triton compiled during it. On 12-05 (before that warm-up)
    the first mixed run of a process was ~35% slower than the next (kernel variants compiled in live passes)."""
    cache = os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")

    def compiled() -> set:  # the kernels Triton has written to its cache (a variant each)
        return {os.path.join(d, f) for d, _, fs in os.walk(cache) for f in fs if f.endswith(".json")
                and not f.startswith("__grp__")}

    eng = _tput_engine(enable_mixed_chunk=True)
    out, new = [], []
    for rep in range(3):
        before = compiled()
        st = drive(eng, random_prompts(256, 512, 400, 20 + rep), {**GREEDY, "max_new_tokens": 128})
        out.append(256 * 128 / st.wall_s)
        new.append(sorted(os.path.basename(f) for f in compiled() - before))
        log(f"mixed_first run {rep + 1}: {out[-1]:.0f} tok/s; kernels compiled in it: {new[-1]}")
    eng.stop()
    res["mixed_first"] = out
    res["mixed_first_compiled"] = new


LLAMA8B_LINEARS = {"qkv": (6144, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}


def _rows_tile_sweep(name: str, n: int, k: int, launch, tiles) -> tuple[tuple, dict]:
    """The several-row GEMV's (block_n, block_k, num_warps) tiles for one linear, each timed at 8 rows in CUDA
    graphs: launch(i, config) runs it on the i-th weight copy. Returns the fastest tile and every time (us)."""
    from kernels.gemv import GemvConfig, split_k_for
    sweep = {}
    for bn, bk in tiles:
        for warps in (4, 8):
            cfg = GemvConfig(bn, bk, split_k_for(n, bn, k, bk), warps)
            try:
                sweep[bn, bk, warps] = graph_time_ms(lambda i: launch(i, cfg)) * 1e3
            except Exception as e:  # noqa: BLE001  (a tile the compiler refuses: out of resources)
                log(f"{name} {bn, bk, warps}: {repr(e)[:120]}")
    tile = min(sweep, key=sweep.get)
    log(f"{name}: best tile at 8 rows {tile}: {sweep[tile]:.1f} us (sweep {len(sweep)})")
    return tile, sweep


def _tile_config(n: int, k: int, tile: tuple):
    from kernels.gemv import GemvConfig, split_k_for
    return GemvConfig(tile[0], tile[1], split_k_for(n, tile[0], k, tile[1]), tile[2])


def _layer_lines(rows: list, keys_at: dict, base: str = "bf16_us") -> None:
    """Each M's four linears summed (a layer), against `base`."""
    for m in sorted({r["M"] for r in rows}):
        at_m = [r for r in rows if r["M"] == m]
        layer = {key: sum(r[key] for r in at_m) for key in at_m[0] if key.endswith("_us")}
        log(f"a layer's four linears at M={m}: " + ", ".join(f"{k_[:-3]} {v:.0f} us" for k_, v in layer.items())
            + "".join(f"; {key[:-3]} / {base[:-3]} {layer[key] / layer[base]:.3f}" for key in keys_at.get(m, ())
                      if key in layer))


def probe_fp8_small_m(res: dict) -> None:
    """FP8 weights (per-row scales) at decode batches of 1..64 rows, each Llama-8B linear alone in CUDA graphs with
    the weights out of L2: bf16 weights (cuBLAS past one row), FP8 as W8A8 (per-token quantization +
    torch._scaled_mm) and FP8 weight-only on the GEMV's tensor-core tile (2-16 rows), at its default tiles and at
    the best of a small sweep at 8 rows."""
    import kernels.ops as ops
    from bench.kernels import copies_for
    from kernels.gemv import gemv
    from shared.models.quantization import quantize_per_channel
    rows, best = [], {}
    for name, (n, k) in LLAMA8B_LINEARS.items():
        w = torch.randn(n, k, dtype=DT, device="cuda") * 0.02
        ws = [w] + [w.clone() for _ in range(copies_for(n * k * 2, cap=8) - 1)]
        q0, s0 = quantize_per_channel(w)
        qs = [(q0, s0)] + [(q0.clone(), s0) for _ in range(copies_for(n * k, cap=8) - 1)]
        x8 = torch.randn(8, k, dtype=DT, device="cuda")
        tile, sweep = _rows_tile_sweep(
            name, n, k, lambda i, cfg: gemv(x8, qs[i % len(qs)][0], scale=qs[i % len(qs)][1], config=cfg),
            ((16, 512), (16, 1024), (32, 256), (32, 512), (32, 1024), (64, 256), (64, 512)))
        best[name] = {"tile": list(tile), "us_at_8": sweep[tile], "sweep": {str(t): v for t, v in sweep.items()}}
        cfg_best = _tile_config(n, k, tile)
        for m in (1, 2, 4, 8, 16, 32, 64):
            x = torch.randn(m, k, dtype=DT, device="cuda")
            row = {"shape": name, "M": m,
                   "bf16_us": graph_time_ms(lambda i: ops.linear(x, ws[i % len(ws)])) * 1e3,
                   "fp8_w8a8_us": graph_time_ms(lambda i: ops.fp8_linear(x, *qs[i % len(qs)])) * 1e3}
            if 2 <= m <= 16:
                row["fp8_w8a16_us"] = graph_time_ms(lambda i: gemv(x, qs[i % len(qs)][0], scale=qs[i % len(qs)][1])) * 1e3
                row["fp8_w8a16_best_us"] = graph_time_ms(
                    lambda i: gemv(x, qs[i % len(qs)][0], scale=qs[i % len(qs)][1], config=cfg_best)) * 1e3
            rows.append(row)
            log(" ".join(f"{k_}={v:.1f}" if isinstance(v, float) else f"{k_}={v}" for k_, v in row.items()))
        del ws, qs
        torch.cuda.empty_cache()
    _layer_lines(rows, {m: ("fp8_w8a8_us", "fp8_w8a16_best_us") for m in (1, 2, 4, 8, 16, 32, 64)})
    res["fp8_small_m"] = {"rows": rows, "best_tiles": best}


def probe_bf16_small_m(res: dict) -> None:
    """bf16 weights at decode batches of 1..16 rows, each Llama-8B linear alone in CUDA graphs with the weights out of
    L2: cuBLAS (the default past one row until 2026-12-06) against the GEMV's tensor-core tile at its default
    tiles (kernels.gemv.BF16_ROWS_TILES) and at the best of a sweep at 8 rows; the one-row GEMV at M = 1 for reference."""
    import kernels.ops as ops
    from bench.kernels import copies_for
    from kernels.gemv import gemv
    rows, best = [], {}
    for name, (n, k) in LLAMA8B_LINEARS.items():
        ws = [torch.randn(n, k, dtype=DT, device="cuda") * 0.02 for _ in range(copies_for(n * k * 2, cap=8))]
        x8 = torch.randn(8, k, dtype=DT, device="cuda")
        tile, sweep = _rows_tile_sweep(
            name, n, k, lambda i, cfg: gemv(x8, ws[i % len(ws)], config=cfg),
            ((16, 256), (16, 512), (32, 128), (32, 256), (32, 512), (64, 128), (64, 256), (128, 128)))
        best[name] = {"tile": list(tile), "us_at_8": sweep[tile], "sweep": {str(t): v for t, v in sweep.items()}}
        cfg_best = _tile_config(n, k, tile)
        for m in (1, 2, 4, 8, 16):
            x = torch.randn(m, k, dtype=DT, device="cuda")
            row = {"shape": name, "M": m, "bf16_us": graph_time_ms(lambda i: x @ ws[i % len(ws)].t()) * 1e3,
                   "gemv_us": graph_time_ms(lambda i: gemv(x, ws[i % len(ws)])) * 1e3}
            if m > 1:
                row["gemv_best_us"] = graph_time_ms(lambda i: gemv(x, ws[i % len(ws)], config=cfg_best)) * 1e3
            rows.append(row)
            log(" ".join(f"{k_}={v:.1f}" if isinstance(v, float) else f"{k_}={v}" for k_, v in row.items()))
        del ws
        torch.cuda.empty_cache()
    _layer_lines(rows, {m: ("gemv_us", "gemv_best_us") for m in (1, 2, 4, 8, 16)})
    res["bf16_small_m"] = {"rows": rows, "best_tiles": best, "gemv_max_m": ops.GEMV_MAX_M}


def probe_fp8_batches_pdl(res: dict) -> None:
    """fp8_batches' engines at kernels.gemv.FP8_ROWS_TILES (its 12-06 sweep) with the several-row GEMV launched with
    and without programmatic dependent launch (kernels.gemv.SEVERAL_ROWS_PDL)."""
    from bench.kernels import copies_for
    from kernels.activation import silu_and_mul
    from kernels.gemv import gemv
    from shared.models.quantization import quantize_per_channel
    n, k = LLAMA8B_LINEARS["down"]  # down_proj alone at 8 rows, its gated input computed in the load or before
    q0, s0 = quantize_per_channel(torch.randn(n, k, dtype=DT, device="cuda") * 0.02)
    qs = [q0] + [q0.clone() for _ in range(copies_for(n * k, cap=8) - 1)]
    h = torch.randn(8, 2 * k, dtype=DT, device="cuda")
    fused = graph_time_ms(lambda i: gemv(h, qs[i % len(qs)], scale=s0, silu_mul=True)) * 1e3
    apart = graph_time_ms(lambda i: gemv(silu_and_mul(h), qs[i % len(qs)], scale=s0)) * 1e3
    log(f"down_proj at 8 rows, FP8 weight-only: gated in the load {fused:.1f} us, silu_and_mul then GEMV {apart:.1f} us")
    res["fp8_down_silu_us"] = {"fused": fused, "apart": apart}
    del qs
    rows = {"kernels.ops.GEMV_MAX_M_FP8": 16}
    probe_fp8_batches(res, variants={"bf16": (None, {}), "fp8": ("fp8", {}), "fp8_rows16": ("fp8", rows),
                                     "fp8_rows16_nopdl": ("fp8", {**rows, "kernels.gemv.SEVERAL_ROWS_PDL": False})},
                      batches=(1, 2, 8, 16, 32), key="fp8_batches_pdl")


def probe_two_row_tiles(res: dict, fp8: bool = False) -> None:
    """kernels.gemv.TWO_ROW_KERNEL's tiles at 2 rows, each Llama-8B linear alone in CUDA graphs with the weights out of
    L2 (down_proj with its gated input, as the engine runs it there): a sweep of the one-row kernel's tile shapes at two
    rows against the tensor-core tile and against one row; then decode steps in the engine at batch 1-4 at the defaults
    (the two-row kernel at two_row_config's tiles), at the sweep's best and on the tensor-core tile, alternated twice.
    fp8: FP8 weights (per-row scales) under TWO_ROW_KERNEL_FP8, their tiles for TWO_ROW_TILES_FP8; the engine's
    variants are then the FP8 default (the knob on, at TWO_ROW_TILES_FP8's tiles since 2026-12-06 09:45), the sweep's
    best and the tensor-core tile (the knob off)."""
    import dataclasses

    import kernels.gemv as kg
    from bench.b1 import module_knobs
    from bench.kernels import copies_for
    from kernels.gemv import gemv
    from shared.models.quantization import quantize_per_channel
    rows, best = [], {}
    knob = {"kernels.gemv.TWO_ROW_KERNEL": True, "kernels.gemv.TWO_ROW_KERNEL_FP8": fp8}
    for name, (n, k) in LLAMA8B_LINEARS.items():
        if fp8:
            q, scale = quantize_per_channel(torch.randn(n, k, dtype=DT, device="cuda") * 0.02)
            ws = [q] + [q.clone() for _ in range(copies_for(n * k, cap=8) - 1)]
        else:
            scale = None
            ws = [torch.randn(n, k, dtype=DT, device="cuda") * 0.02 for _ in range(copies_for(n * k * 2, cap=8))]
        silu = name == "down"
        x1, x2 = (torch.randn(m, 2 * k if silu else k, dtype=DT, device="cuda") for m in (1, 2))
        run = lambda x, cfg=None: (lambda i: gemv(x, ws[i % len(ws)], config=cfg, scale=scale,  # noqa: E731
                                                  silu_mul=silu))
        row = {"shape": name, "one_row_us": graph_time_ms(run(x1)) * 1e3}
        with module_knobs({"kernels.gemv.TWO_ROW_KERNEL": False, "kernels.gemv.TWO_ROW_KERNEL_FP8": False}):
            row["tensor_cores_us"] = graph_time_ms(run(x2)) * 1e3
        sweep = {}
        with module_knobs(knob):
            row["rule_us"] = graph_time_ms(run(x2)) * 1e3
            base = kg.two_row_config(n, k, ws[0].element_size())
            for bn in (2, 4, 8):
                for bk in (256, 512, 1024, 2048):
                    for warps in (2, 4):
                        cfg = dataclasses.replace(base, block_n=bn, block_k=bk, num_warps=warps, narrow=True, fold=1,
                                                  split_k=kg.split_k_for(n, bn, k, bk))
                        try:
                            sweep[bn, bk, warps] = graph_time_ms(run(x2, cfg)) * 1e3
                        except Exception as e:  # noqa: BLE001  (a tile the compiler refuses)
                            log(f"{name} {bn, bk, warps}: {repr(e)[:120]}")
        tile = min(sweep, key=sweep.get)
        row["best_us"], best[name] = sweep[tile], {"tile": list(tile), "sweep": {str(t): v for t, v in sweep.items()}}
        rows.append(row)
        log(f"{name}: one row {row['one_row_us']:.1f} us; two rows: tensor cores {row['tensor_cores_us']:.1f}, two-row "
            f"kernel at the rule {row['rule_us']:.1f}, at its best tile {tile} {row['best_us']:.1f}")
        del ws
        torch.cuda.empty_cache()
    layer = {key: sum(r[key] for r in rows) for key in rows[0] if key.endswith("_us")}
    log("a layer's four linears: " + ", ".join(f"{k_[:-3]} {v:.0f} us" for k_, v in layer.items()))
    res["two_row_tiles_fp8" if fp8 else "two_row_tiles"] = {"rows": rows, "best_tiles": best}
    tiles = {LLAMA8B_LINEARS[name]: tuple(b["tile"]) for name, b in best.items()}
    if fp8:  # the default (the knob at its table's tiles) against the sweep's tiles and the tensor-core tile
        tc, swept = {"kernels.gemv.TWO_ROW_KERNEL_FP8": False}, {"kernels.gemv.TWO_ROW_TILES_FP8": tiles}
        v = {"fp8": ("fp8", {}), "fp8_two_swept": ("fp8", swept), "fp8_tensor_cores": ("fp8", tc)}
    else:  # the default (two rows on the row kernel at two_row_config's rule since 2026-12-06) against the sweep's
        # tiles and the tensor-core tile
        tc, swept = {"kernels.gemv.TWO_ROW_KERNEL": False}, {"kernels.gemv.TWO_ROW_TILES": tiles}
        v = {"bf16": (None, {}), "two_rows_swept": (None, swept), "tensor_cores": (None, tc)}
    v.update({name + "_again": spec for name, spec in v.items()})
    probe_fp8_batches(res, variants=v, batches=(1, 2, 4), key="two_row_batches_fp8" if fp8 else "two_row_batches",
                      swept=False)


def probe_two_row_tiles_fp8(res: dict) -> None:
    probe_two_row_tiles(res, fp8=True)


def probe_lm_head_rows(res: dict) -> None:
    """Llama-8B's lm_head (128256 x 4096, bf16) at decode batches of 2-16 rows in CUDA graphs: cuBLAS writing the
    logits buffer (the default) against the GEMV's tensor-core tile at its default tile and the best of a sweep at
    8 rows; then decode steps in the engine with the logits on the GEMV (shared.models.llama.LM_HEAD_ROWS_GEMV, the
    default since 2026-12-06) at that tile, alternated twice with cuBLAS ("bf16", the knob off)."""
    from kernels.gemv import gemv
    n, k = 128256, HIDDEN
    w = torch.randn(n, k, dtype=DT, device="cuda") * 0.02
    x8, out8 = torch.randn(8, k, dtype=DT, device="cuda"), torch.empty(8, n, dtype=DT, device="cuda")
    tile, sweep = _rows_tile_sweep("lm_head", n, k, lambda i, cfg: gemv(x8, w, out=out8, config=cfg),
                                   ((16, 256), (32, 128), (32, 256), (64, 128), (64, 256), (128, 128)))
    cfg_best = _tile_config(n, k, tile)
    rows = []
    for m in (1, 2, 4, 8, 16):
        x, out = torch.randn(m, k, dtype=DT, device="cuda"), torch.empty(m, n, dtype=DT, device="cuda")
        row = {"M": m, "cublas_us": graph_time_ms(lambda i: torch.mm(x, w.t(), out=out)) * 1e3,
               "gemv_us": graph_time_ms(lambda i: gemv(x, w, out=out)) * 1e3}
        if m > 1:
            row["gemv_best_us"] = graph_time_ms(lambda i: gemv(x, w, out=out, config=cfg_best)) * 1e3
        rows.append(row)
        log(" ".join(f"{k_}={v:.1f}" if isinstance(v, float) else f"{k_}={v}" for k_, v in row.items()))
    res["lm_head_rows"] = {"rows": rows, "tile": list(tile), "sweep": {str(t): v for t, v in sweep.items()}}
    del w
    torch.cuda.empty_cache()
    import kernels.gemv as kg
    on = {"shared.models.llama.LM_HEAD_ROWS_GEMV": True,
          "kernels.gemv.BF16_ROWS_TILES": {**kg.BF16_ROWS_TILES, (n, k): tuple(tile)}}
    off = {"shared.models.llama.LM_HEAD_ROWS_GEMV": False}
    probe_fp8_batches(res, variants={"bf16": (None, off), "lm_gemv": (None, on), "bf16_again": (None, off),
                                     "lm_gemv_again": (None, on)}, batches=(1, 2, 4, 8, 16), key="lm_head_batches",
                      swept=False)


def swept_variants(res: dict) -> dict:
    """probe_fp8_batches' variants at the tiles fp8_small_m / bf16_small_m found best at 8 rows, where that sweep ran
    first in this process (bf16 on the several-row GEMV up to 16 rows)."""
    out = {}
    for sweep_key, name, quant, knobs in (("fp8_small_m", "fp8_swept", "fp8", {}),
                                          ("bf16_small_m", "bf16_rows16_swept", None, {"kernels.ops.GEMV_MAX_M": 16})):
        swept = res.get(sweep_key, {}).get("best_tiles")
        if swept:
            import kernels.gemv as kg
            tiles = {LLAMA8B_LINEARS[n_]: tuple(b["tile"]) for n_, b in swept.items()}
            table = "FP8_ROWS_TILES" if quant else "BF16_ROWS_TILES"  # the swept shapes replaced, the rest kept
            out[name] = (quant, {**knobs, f"kernels.gemv.{table}": {**getattr(kg, table), **tiles}})
            log(f"{name}: the swept tiles {tiles}")
    return out


def probe_fp8_batches(res: dict, variants: dict | None = None, batches: tuple = (1, 2, 4, 8, 16, 32, 64),
                      key: str = "fp8_batches", swept: bool = True) -> None:
    """Decode steps at batch 1..64 (the engine loop, graphs to 64, 256-token prompts, Llama-8B shape): bf16 weights,
    FP8 at the defaults (weight-only GEMVs up to kernels.ops.GEMV_MAX_M_FP8 rows since 2026-12-06) and FP8 with W8A8
    past one row (the former path).
    Median period between decode launches at each batch, and each captured graph's replay."""
    from shared.engine.config import EngineConfig
    from shared.engine.engine import Engine
    from shared.tokenizer import Tokenizer
    from bench.b1 import module_knobs
    path = model_dir("llama-3.1-8b")
    variants = variants or {"bf16": (None, {}), "fp8": ("fp8", {}),
                            "fp8_w8a8": ("fp8", {"kernels.ops.GEMV_MAX_M_FP8": 1})}
    if swept:
        variants.update(swept_variants(res))
    out: dict = {}
    for name, (quant, knobs) in variants.items():
        with module_knobs(knobs):
            extra = {"quantization": quant} if quant else {}
            ec = EngineConfig(model_path=path, load_format="dummy", max_context_len=4096, max_total_tokens=100_000,
                              max_running_requests=64, cuda_graph=True, cuda_graph_max_bs=64, enable_pdl=True, **extra)
            eng = Engine(ec, Tokenizer.load(path), on_output=lambda o: None)
            drive(eng, random_prompts(4, 64, 400, 0), {**GREEDY, "max_new_tokens": 8})
            fig = {}
            for bs in batches:
                st = drive(eng, random_prompts(bs, 256, 400, 40 + bs), {**GREEDY, "max_new_tokens": 48})
                period = statistics.median(st.decode_periods(bs)) * 1e3
                gr = eng.runner.graph_runner
                replay = graph_replay_ms(gr, bs=bs, reps=30) if gr is not None and (bs, False) in gr.graphs else float("nan")
                fig[bs] = {"period_ms": period, "replay_ms": replay}
                log(f"{name} batch {bs}: period {period:.3f} ms, replay {replay:.3f} ms")
            eng.stop()
            out[name] = fig
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    ref = next(iter(out))  # the first variant ("bf16" where there is one) is the others' reference
    for bs in batches:
        b = out[ref][bs]["period_ms"]
        log(f"batch {bs}: {ref} {b:.3f} ms; " + "; ".join(
            f"{name} {out[name][bs]['period_ms']:.3f} ({out[name][bs]['period_ms'] / b:.3f}x)" for name in out
            if name != ref))
    res[key] = out


def probe_trace_prefill(res: dict) -> None:
    """The workload's prefill (256 x 512 tokens in 8k-token extend passes, eager) kernel by kernel: where
    the time that is not GEMM goes, and how long the device waits between kernels."""
    from torch.profiler import ProfilerActivity, profile
    eng = _tput_engine()
    drive(eng, random_prompts(16, 512, 400, 4), {**GREEDY, "max_new_tokens": 1})
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        drive(eng, random_prompts(256, 512, 400, 5), {**GREEDY, "max_new_tokens": 1})
    _kernel_table(res, "trace_prefill", [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA],
                  256 * 512 // 8192, "per 8k-token pass")
    eng.stop()


def probe_extend_layout(res: dict) -> None:
    """Why the engine's extend kernel (2 x 4096, no prefix) runs slower inside a prefill pass than alone:
    q/k/v as the engine hands them (views of the fused qkv projection's output, rows 6144 apart) against
    contiguous tensors, and the kernel right after a gate_up-sized GEMM (the pass's heat) minus that
    GEMM alone."""
    from kernels.attention.triton_extend import extend_attention
    B, L = 2, 4096
    q, k, v, kb, r2t, req, zero, lens, starts, cu, flops, out = _packed_batch(B, L)
    qkv = torch.randn(B * L, (HQ + 2 * HKV) * D, dtype=DT, device="cuda")
    qv, kv_, vv = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    qv, kv_, vv = qv.view(-1, HQ, D), kv_.view(-1, HKV, D), vv.view(-1, HKV, D)
    x = torch.randn(B * L, HIDDEN, dtype=DT, device="cuda")
    w = torch.randn(2 * INTER, HIDDEN, dtype=DT, device="cuda")
    rows = []
    gemm = graph_time_ms(lambda i: torch.nn.functional.linear(x, w), reps=7)
    rows.append({"case": "gate_up GEMM alone", "us": gemm * 1e3})
    for name, (a, b_, c) in [("contiguous", (q, k, v)), ("qkv views", (qv, kv_, vv))]:
        def call(i, a=a, b_=b_, c=c):
            extend_attention(a, b_, c, kb, kb, r2t, req, zero, lens, starts, L, D ** -0.5, out=out)
        t = graph_time_ms(call, reps=7)
        t2 = graph_time_ms(lambda i: (torch.nn.functional.linear(x, w), call(i)), reps=7)
        rows.append({"case": name, "us": t * 1e3, "TFLOPs": flops / t / 1e9, "after_gemm_us": (t2 - gemm) * 1e3})
        log(rows[-1])
    # Inputs out of L2, as in a pass (q, k, v were written a rope kernel ago, 100 MB through a 50 MB L2):
    # four input sets in turn, each ~100 MB.
    sets = [tuple(torch.randn_like(x) for x in (q, k, v)) for _ in range(4)]
    t = graph_time_ms(lambda i: extend_attention(*sets[i % 4], kb, kb, r2t, req, zero, lens, starts, L, D ** -0.5,
                                                 out=out), reps=7)
    rows.append({"case": "contiguous, 4 input sets in turn", "us": t * 1e3, "TFLOPs": flops / t / 1e9})
    log(rows[-1])
    res["extend_layout"] = rows


def _prefill_4k(eng) -> dict:
    """bench.offline's prefill measurement on eng: 16 prompts of 4096 tokens in 8k-token passes, each pass synced and
    timed (a compile pass of two prompts first, the cache reset around both): TFLOP/s (attention counted) and ms a
    pass over the full passes."""
    from bench.common import SHAPES, full_pass_rate, prefill_flops_per_token
    eng.cache.reset()
    drive(eng, random_prompts(2, 4096, 400, 29), {**GREEDY, "max_new_tokens": 1})  # compile
    eng.cache.reset()
    st = drive(eng, random_prompts(16, 4096, 400, 30), {**GREEDY, "max_new_tokens": 1}, time_steps=True)
    tok_s, pass_s = full_pass_rate(st, 8192)
    return {"prefill_tflops": tok_s * prefill_flops_per_token(SHAPES["llama-3.1-8b"], 4096) / 1e12, "pass_ms": 1e3 * pass_s}


def probe_prefill_tiles(res: dict) -> None:
    """bench.offline's prefill measurement (16 x 4096 tokens, 8k-token passes, each pass synced and timed)
    with the extend kernel's tile for long prompts varied in the engine itself (inside a pass its inputs
    come cold from HBM, so the tile that wins alone need not win there), alternated, with the matmul
    reference of the same call."""
    import kernels.attention.triton_extend as te
    from bench.common import measure_matmul_tflops
    default = te.extend_block_sizes
    eng = _tput_engine()
    rows = []
    for tiles in [None, (128, 64, 8, 3), (128, 128, 8, 3), None, (128, 64, 8, 3), (128, 128, 8, 3)]:
        te.extend_block_sizes = default if tiles is None else (
            lambda d, dt, r=None, t=tiles: t if r is not None and r >= 1024 else default(d, dt, r))
        rows.append({"tiles": str(tiles or "default"), **_prefill_4k(eng)})
        log(rows[-1])
    te.extend_block_sizes = default
    eng.stop()
    ref = measure_matmul_tflops()
    for r in rows:
        r["of_matmul"] = r["prefill_tflops"] / ref
    log(f"matmul reference {ref:.0f} TFLOP/s; " + ", ".join(f"{r['tiles']}: {r['of_matmul']:.3f}" for r in rows))
    res["prefill_tiles"] = {"rows": rows, "matmul_tflops": ref}


def probe_trace_prefill4k(res: dict) -> None:
    """bench.offline's prefill goal workload (16 prompts of 4096 tokens, 8k-token passes of two prompts,
    eager), kernel by kernel: what besides the GEMMs separates it from the matmul rate."""
    from torch.profiler import ProfilerActivity, profile
    eng = _tput_engine()
    drive(eng, random_prompts(2, 4096, 400, 29), {**GREEDY, "max_new_tokens": 1})
    eng.cache.reset()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        drive(eng, random_prompts(16, 4096, 400, 30), {**GREEDY, "max_new_tokens": 1})
    _kernel_table(res, "trace_prefill4k", [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA],
                  8, "per 8k-token pass")
    eng.stop()


def _trace_graph(res, g, key, reps: int = 10):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    _kernel_table(res, key, [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA], reps,
                  "per replay")


def _kernel_table(res, key, evs, reps, per):
    evs.sort(key=lambda e: e.time_range.start)
    agg = collections.defaultdict(lambda: [0, 0.0])
    busy = 0.0
    for e in evs:
        d = e.time_range.end - e.time_range.start
        agg[e.name[:90]][0] += 1
        agg[e.name[:90]][1] += d
        busy += d
    span = (evs[-1].time_range.end - evs[0].time_range.start) if evs else 0
    gaps = [evs[i + 1].time_range.start - evs[i].time_range.end for i in range(len(evs) - 1)]
    table = sorted(((n, c / reps, t / reps) for n, (c, t) in agg.items()), key=lambda r: -r[2])
    # Kernels overlap under PDL, so durations do not add up to the span. Charged time does: each kernel is
    # charged from the latest end before it (or its own start, if later) to its own end, so the charges sum
    # to the span minus idle gaps, and a kernel hidden under its neighbours is charged ~0.
    charged: dict = collections.defaultdict(float)
    last_end = None
    for e in evs:
        lo = e.time_range.start if last_end is None else max(e.time_range.start, min(last_end, e.time_range.end))
        charged[e.name[:90]] += max(0.0, e.time_range.end - lo)
        last_end = e.time_range.end if last_end is None else max(last_end, e.time_range.end)
    log(f"{key}: charged time per replay (each kernel from the latest earlier end to its own end)")
    for n, t in sorted(charged.items(), key=lambda r: -r[1])[:12]:
        print(f"  {t / reps:8.1f} us charged  {n}", flush=True)
    t0 = evs[0].time_range.start if evs else 0
    first = [(e.name[:40], round(e.time_range.start - t0, 2), round(e.time_range.end - t0, 2))
             for e in evs[:len(evs) // max(reps, 1)]]
    log(f"{key}: {len(evs) / reps:.0f} kernels {per}, busy {busy / reps:.0f} us, span {span / reps:.0f} us, "
        f"median gap {statistics.median(gaps) if gaps else 0:.2f} us")
    for n, c, t in table[:25]:
        print(f"  {t:8.1f} us  {c:6.0f}x  {t / max(c, 1):6.2f} us each  {n}", flush=True)
    res[key] = {"kernels_per_replay": len(evs) / reps, "busy_us": busy / reps, "span_us": span / reps,
                    "median_gap_us": statistics.median(gaps) if gaps else 0,
                    "charged_us": {n: t / reps for n, t in charged.items()}, "first_timeline": first,
                    "top": [{"name": n, "count": c, "us": t} for n, c, t in table[:40]]}


def probe_steps(res: dict) -> None:
    """What the GPU does between two batch-1 graph replays in the engine loop (overlap on): the kernels
    outside the graph (sampling, copies) and the idle time, from a torch.profiler trace of 40 steps."""
    eng = b1_engine(True)
    drive(eng, random_prompts(1, 512, 400, 2), {**GREEDY, "max_new_tokens": 32})
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        st = drive(eng, random_prompts(1, 512, 400, 3), {**GREEDY, "max_new_tokens": 48})
    evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    # A replay ends with lm_head (the one cuBLAS GEMV of the graph) and starts with the embedding lookup.
    ends = [i for i, e in enumerate(evs) if e.name.startswith("nvjet")]
    between = collections.defaultdict(lambda: [0, 0.0])
    idle, n_gaps = 0.0, 0
    for a, b in zip(ends, ends[1:]):
        j = a + 1
        while j < b and "indexSelect" not in evs[j].name:
            j += 1
        seg = evs[a + 1:j]
        t_prev = evs[a].time_range.end
        for e in seg:
            between[e.name[:80]][0] += 1
            between[e.name[:80]][1] += e.time_range.end - e.time_range.start
            idle += max(0.0, e.time_range.start - t_prev)
            t_prev = e.time_range.end
        if j < b:
            idle += max(0.0, evs[j].time_range.start - t_prev)
        n_gaps += 1
    n = max(1, n_gaps)
    rows = sorted(((k, c / n, t / n) for k, (c, t) in between.items()), key=lambda r: -r[2])
    log(f"steps: {st.steps}, {n} replay boundaries: idle {idle / n:.1f} us per boundary, "
        f"kernels between {sum(r[2] for r in rows):.1f} us")
    for k, c, t in rows[:20]:
        print(f"  {t:7.1f} us {c:5.1f}x  {k}", flush=True)
    cpu = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU:
            cpu[e.name[:80]] += e.time_range.end - e.time_range.start
    top = sorted(cpu.items(), key=lambda kv: -kv[1])[:25]
    print("host ops (inclusive us per step):", flush=True)
    for k, t in top:
        print(f"  {t / max(1, st.steps):8.1f}  {k}", flush=True)
    res["steps"] = {"idle_us_per_boundary": idle / n, "between": [{"name": k, "count": c, "us": t} for k, c, t in rows],
                    "host_top": [{"name": k, "us_per_step": t / max(1, st.steps)} for k, t in top]}
    eng.stop()


def probe_tput(res: dict) -> None:
    """Where the throughput workload's time goes (256 x (512 in, 128 out), all at once, steps synced):
    prefill passes against the matmul-rate model, decode steps against the weights + KV stream model of
    bench/offline.py, and against one that also counts decode's matmul compute (at batch 256 the GEMMs are
    compute-bound: 2 x params x batch FLOPs take longer than streaming the weights)."""
    from bench.common import (LLAMA31_8B, kv_bytes_per_token, matmul_params, measure_copy_bandwidth,
                              measure_matmul_tflops, param_bytes)
    from shared.engine.config import EngineConfig
    from shared.engine.engine import Engine
    from shared.tokenizer import Tokenizer
    cfg = LLAMA31_8B
    bw = measure_copy_bandwidth()
    tf = measure_matmul_tflops() * 1e12
    path = model_dir("llama-3.1-8b")
    tok = Tokenizer.load(path)
    ec = EngineConfig(model_path=path, load_format="dummy", max_context_len=8192, max_running_requests=256,
                      chunked_prefill_size=8192, max_prefill_tokens=8192, cuda_graph=True)
    eng = Engine(ec, tok, on_output=lambda o: None)
    drive(eng, random_prompts(8, 64, 400, 0), {**GREEDY, "max_new_tokens": 8})
    st_free = drive(eng, random_prompts(256, 512, 400, 5), {**GREEDY, "max_new_tokens": 128})
    st = drive(eng, random_prompts(256, 512, 400, 6), {**GREEDY, "max_new_tokens": 128}, time_steps=True)
    mp = matmul_params(cfg)
    w = param_bytes(cfg) - cfg["vocab_size"] * cfg["hidden_size"] * 2
    kvb = kv_bytes_per_token(cfg)
    L, H, D = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["head_dim"]
    pf_model = sum(t * 2 * mp + 4 * L * H * D * t * 512 / 2 for t in st.extend_step_tokens) / tf
    dec_mem, dec_cmp = 0.0, 0.0
    ctx = 512
    for bs in st.decode_step_bs:
        kv = bs * ctx * kvb
        dec_mem += (w + kv) / bw
        dec_cmp += max(2 * mp * bs / tf, w / bw) + kv / bw
        ctx += 1
    out = {"wall_free_s": st_free.wall_s, "wall_synced_s": st.wall_s, "extend_s": sum(st.extend_step_s),
           "extend_passes": len(st.extend_step_s), "extend_tokens": sum(st.extend_step_tokens),
           "prefill_model_s": pf_model, "decode_s": sum(st.decode_step_s), "decode_steps": len(st.decode_step_s),
           "decode_model_mem_s": dec_mem, "decode_model_compute_s": dec_cmp,
           "decode_bs_hist": dict(collections.Counter(st.decode_step_bs).most_common(6))}
    big = [t for t, b in zip(st.decode_step_s, st.decode_step_bs) if b == 256]
    if big:
        out["decode_b256_ms_median"] = statistics.median(big) * 1e3
    # Free-running again with CUDA events around each decode pass: is a batch-256 step bound by the device
    # (the period between launches equals the pass's device time) or by the host (the period is longer and
    # the device waits)?
    st_ev = drive(eng, random_prompts(256, 512, 400, 7), {**GREEDY, "max_new_tokens": 128}, measure_idle=True)
    dev = [ms for ms, b in zip(st_ev.decode_device_ms, st_ev.decode_step_bs) if b == 256]
    per = st_ev.decode_periods(256)
    if dev and per:
        out["b256_device_ms_median"] = statistics.median(dev)
        out["b256_period_ms_median"] = statistics.median(per) * 1e3
        out["b256_device_ms_sum"] = sum(dev)
        out["b256_period_ms_sum"] = sum(per) * 1e3
        out["wall_events_s"] = st_ev.wall_s
        log(f"batch-256 decode, free-running: period between launches {out['b256_period_ms_median']:.2f} ms "
            f"(median), device time {out['b256_device_ms_median']:.2f} ms; {len(dev)} passes")
    log(out)
    res["tput"] = out
    eng.stop()


def probe_gemm_tune(res: dict) -> None:
    """Whether cuBLAS's default picks leave speed on the table for the prefill and batch-256 GEMMs: each
    Llama-8B linear at M = 8192 and 256 (and the 8192^3 reference), timed with the default heuristic, then
    with PyTorch's TunableOp after it tried the cuBLASLt candidates for that shape."""
    import torch.cuda.tunable as tunable
    shapes = [(m, n, k) for m in (8192, 256) for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]]
    shapes.append((8192, 8192, 8192))
    dev = torch.device("cuda")

    def timed(x, w, reps=20):
        for _ in range(3):
            torch.nn.functional.linear(x, w)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for _ in range(reps):
            a.record()
            torch.nn.functional.linear(x, w)
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3)
        return sorted(ts)[len(ts) // 2]

    data = {s: (torch.randn(s[0], s[2], device=dev, dtype=torch.bfloat16),
                torch.randn(s[1], s[2], device=dev, dtype=torch.bfloat16) * 0.02) for s in shapes}
    before = {s: timed(*data[s]) for s in shapes}
    tunable.enable(True)
    tunable.tuning_enable(True)
    tunable.set_max_tuning_iterations(30)
    tunable.set_max_tuning_duration(200)
    t0 = time.time()
    for s in shapes:
        torch.nn.functional.linear(*data[s])
    torch.cuda.synchronize()
    tune_s = time.time() - t0
    tunable.tuning_enable(False)
    after = {s: timed(*data[s]) for s in shapes}
    tunable.enable(False)
    rows = []
    for s in shapes:
        fl = 2 * s[0] * s[1] * s[2]
        rows.append({"shape": list(s), "default_us": before[s], "tuned_us": after[s],
                     "default_tflops": fl / before[s] / 1e6, "tuned_tflops": fl / after[s] / 1e6})
        log(f"M={s[0]:5d} N={s[1]:5d} K={s[2]:5d}: default {before[s]:8.1f} us ({fl / before[s] / 1e6:4.0f} TFLOP/s)"
            f"  tuned {after[s]:8.1f} us ({fl / after[s] / 1e6:4.0f})  {after[s] / before[s]:.3f}x")
    for m in (8192, 256):
        sb = sum(before[s] for s in shapes[:-1] if s[0] == m)
        sa = sum(after[s] for s in shapes[:-1] if s[0] == m)
        log(f"a layer's four GEMMs at M={m}: default {sb:.0f} us, tuned {sa:.0f} us ({sa / sb:.3f}x)")
    try:
        results = tunable.get_results()
    except Exception as e:  # noqa: BLE001
        results = repr(e)
    log(f"tuning took {tune_s:.1f} s; TunableOp results: {str(results)[:600]}")
    res["gemm_tune"] = {"rows": rows, "tune_s": tune_s, "results": str(results)[:4000]}


def main() -> int:
    what = sys.argv[1:] or ["pdl", "extend", "trace"]
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "triton": __import__("triton").__version__, "date": time.strftime("%Y-%m-%d %H:%M")}
    for w in what:
        try:
            {"pdl": probe_pdl, "extend": probe_extend, "trace": probe_trace, "b1": probe_b1,
             "trace_pdl": probe_trace_pdl, "trace_pdl_early": probe_trace_pdl_early,
             "trace_pdl_whole": probe_trace_pdl_whole, "trace_pdl_prefetch": probe_trace_pdl_prefetch,
             "trace_pdl_rope": probe_trace_pdl_rope, "trace_pdl_kv": probe_trace_pdl_kv,
             "trace_pdl_fp8": probe_trace_pdl_fp8, "trace_pdl_b2": probe_trace_pdl_b2, "trace_pdl_b2_fp8": probe_trace_pdl_b2_fp8, "two_row_tiles_fp8": probe_two_row_tiles_fp8, "steps": probe_steps, "eager_host": probe_eager_host, "trace_extend": probe_trace_extend,
             "extend_pack": probe_extend_pack, "prefill_attn": probe_prefill_attn,
             "tput": probe_tput, "tput_breakdown": probe_tput_breakdown, "trace256": probe_trace256, "trace256_kvfp8": lambda res: probe_trace256(res, "fp8_e4m3"), "decode256": probe_decode256, "decode256_ab": probe_decode256_ab, "decode256_layout": probe_decode256_layout, "tput_page": probe_tput_page, "kvfp8": probe_kvfp8, "kvfp8_kernel": probe_kvfp8_kernel, "kvfp8_tiles": probe_kvfp8_tiles, "kvfp8_tput": probe_kvfp8_tput, "tput_clocks": probe_tput_clocks, "mixed_first": probe_mixed_first, "b1phases": probe_b1phases, "trace_prefill": probe_trace_prefill,
             "trace_prefill4k": probe_trace_prefill4k, "prefill_attn_tma": probe_prefill_attn_tma, "extend_layout": probe_extend_layout,
             "prefill_tiles": probe_prefill_tiles,
             "gemm_tune": probe_gemm_tune,
             "fp8_small_m": probe_fp8_small_m, "fp8_batches": probe_fp8_batches, "bf16_small_m": probe_bf16_small_m,
             "lm_head_rows": probe_lm_head_rows, "two_row_tiles": probe_two_row_tiles,
             "fp8_batches_pdl": probe_fp8_batches_pdl}[w](res)
        except Exception as e:
            import traceback
            traceback.print_exc()
            res[w + "_error"] = repr(e)[:300]
        gc.collect()  # the probe's engine sits in reference cycles: free its KV pool before the next one's
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "probe.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
