"""GPU benchmark of the Triton kernels against their torch references and the machine's ceilings.

    python -m bench.kernels [--out DIR] [--tune] [elementwise gemv decode extend fusions]

Under 3 minutes on an H100 or H200; prints a table last and writes kernels.json to --out. Names pick parts
(e.g. `fusions`: only the decode fusions, each against the launches it replaces); --tune sweeps the GEMV and
extend-attention block choices on this GPU instead.

Ceilings are measured first in the same run: device copy bandwidth (large D2D copy, bytes read +
written) and bf16 matmul TFLOP/s. Every timing is the median over replays of a CUDA graph holding
many calls; memory-bound cases rotate over enough copies of their inputs that the working set
exceeds L2, so the bandwidth figures are HBM figures. Shapes are Llama-3.1-8B's.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time

import torch

from shared.gc_freeze import collections_paused

HQ, HKV, D, HIDDEN, INTER = 32, 8, 128, 4096, 14336
DT = torch.bfloat16
L2_FLUSH_BYTES = 256 << 20  # several times the H200's L2


def graph_time_ms(fn, reps: int = 15, target_ms: float = 3.0) -> float:
    """Median time of one fn() call, from CUDA-graph replays. fn(i) gets a call counter so callers can
    rotate inputs."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # compile / autotune outside the capture
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(5):
        fn(i)
    end.record()
    end.synchronize()
    per_call = max(start.elapsed_time(end) / 5, 1e-3)
    n_inner = int(min(500, max(1, target_ms / per_call)))
    g = torch.cuda.CUDAGraph()
    with collections_paused(), torch.cuda.graph(g):  # a collection mid-capture can invalidate it (shared/gc_freeze.py)
        for i in range(n_inner):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / n_inner)
    return statistics.median(times)


def copies_for(nbytes: int, cap: int = 64) -> int:
    return max(1, min(cap, math.ceil(L2_FLUSH_BYTES / max(1, nbytes))))


def eager_time_ms(fn, reps: int = 10) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_ceilings() -> dict:
    # The matmul goes first: it also brings the clocks up from idle before the copy is timed.
    m = 8192
    x = torch.randn(m, m, dtype=DT, device="cuda")
    y = torch.randn(m, m, dtype=DT, device="cuda")
    t = graph_time_ms(lambda i: torch.matmul(x, y), reps=10, target_ms=20)
    tflops = 2 * m ** 3 / t / 1e9
    del x, y
    n = 1 << 30  # 2 GiB of bf16 each side
    a = torch.empty(n, dtype=DT, device="cuda")
    b = torch.empty_like(a)
    # A captured copy may become a copy-engine node, slower than the kernel an eager copy launches,
    # so take the better of an eager copy and a captured elementwise kernel.
    t = min(eager_time_ms(lambda: b.copy_(a)), graph_time_ms(lambda i: torch.neg(a, out=b), reps=10))
    copy_gbs = 2 * a.numel() * a.element_size() / t / 1e6
    return {"copy_GBps": copy_gbs, "matmul_TFLOPs": tflops}


class Report:
    def __init__(self, ceilings: dict):
        self.ceil = ceilings
        self.rows: list[dict] = []

    def add(self, kernel: str, case: str, t_triton: float, t_torch: float | None, *, nbytes: float = 0,
            flops: float = 0, torch_name: str = "torch"):
        row = {"kernel": kernel, "case": case, "triton_us": t_triton * 1e3,
               "torch_us": None if t_torch is None else t_torch * 1e3, "baseline": torch_name,
               "speedup": None if t_torch is None else t_torch / t_triton}
        if flops:
            row["TFLOPs"] = flops / t_triton / 1e9
            row["of_ceiling"] = row["TFLOPs"] / self.ceil["matmul_TFLOPs"]
        else:
            row["GBps"] = nbytes / t_triton / 1e6
            row["of_ceiling"] = row["GBps"] / self.ceil["copy_GBps"]
        self.rows.append(row)
        print(f"  {kernel:10s} {case:28s} {row['triton_us']:9.1f} us  "
              f"{'' if t_torch is None else f'{torch_name} {t_torch * 1e3:9.1f} us'}", flush=True)

    def table(self) -> str:
        head = f"{'kernel':10s} {'case':28s} {'triton us':>10s} {'torch us':>10s} {'speedup':>8s} {'achieved':>14s} {'of ceil':>8s}"
        lines = [head, "-" * len(head)]
        for r in self.rows:
            ach = f"{r['TFLOPs']:.0f} TFLOP/s" if "TFLOPs" in r else f"{r['GBps']:.0f} GB/s"
            lines.append(f"{r['kernel']:10s} {r['case']:28s} {r['triton_us']:10.1f} "
                         f"{'' if r['torch_us'] is None else format(r['torch_us'], '10.1f'):>10s} "
                         f"{'' if r['speedup'] is None else format(r['speedup'], '7.2f') + 'x':>8s} "
                         f"{ach:>14s} {r['of_ceiling'] * 100:7.0f}%")
        return "\n".join(lines)


def bench_elementwise(rep: Report):
    from kernels import reference as ref
    from kernels.activation import silu_and_mul
    from kernels.kv_store import store_kv
    from kernels.norm import rms_norm
    from kernels.rope import apply_rope

    def rand(*shape):
        return torch.randn(*shape, dtype=DT, device="cuda")

    for T in (1, 4096):
        n = copies_for(T * HIDDEN * 2 * 2)
        xs, rs = [rand(T, HIDDEN) for _ in range(n)], [rand(T, HIDDEN) for _ in range(n)]
        w = rand(HIDDEN)
        nb = 4 * T * HIDDEN * 2  # read x, r; write y, r
        rep.add("rmsnorm", f"T={T} +residual", graph_time_ms(lambda i: rms_norm(xs[i % n], w, 1e-5, rs[i % n])),
                graph_time_ms(lambda i: ref.rms_norm_ref(xs[i % n], w, 1e-5, rs[i % n])), nbytes=nb)

        n = copies_for(T * INTER * 2 * 2)
        gs = [rand(T, 2 * INTER) for _ in range(n)]
        rep.add("silu_mul", f"T={T} I={INTER}", graph_time_ms(lambda i: silu_and_mul(gs[i % n])),
                graph_time_ms(lambda i: ref.silu_and_mul_ref(gs[i % n])), nbytes=T * INTER * 2 * 3)

        n = copies_for(T * (HQ + HKV) * D * 2)
        qkvs = [rand(T, (HQ + 2 * HKV) * D) for _ in range(n)]
        inv = 1.0 / (500000 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D))
        cache = ref.rope_cos_sin_cache(inv, 131072)
        pos = torch.randint(0, 131072, (T,), device="cuda")
        split = lambda qkv: (qkv[:, :HQ * D], qkv[:, HQ * D:(HQ + HKV) * D])  # noqa: E731
        nb = 2 * T * (HQ + HKV) * D * 2 + T * D * 4
        rep.add("rope", f"T={T}", graph_time_ms(lambda i: apply_rope(*split(qkvs[i % n]), pos, cache, D)),
                graph_time_ms(lambda i: ref.rope_ref(*split(qkvs[i % n]), pos, cache, D)), nbytes=nb)

        n = copies_for(T * 2 * HKV * D * 2)
        kb = torch.zeros(T * 4 + 64, HKV, D, dtype=DT, device="cuda")
        vb = torch.zeros_like(kb)
        kvs = [rand(T, 2, HKV, D) for _ in range(n)]
        loc = torch.randperm(kb.shape[0], device="cuda")[:T]
        nb = 2 * T * 2 * HKV * D * 2
        rep.add("store_kv", f"T={T}", graph_time_ms(lambda i: store_kv(kb, vb, loc, kvs[i % n][:, 0], kvs[i % n][:, 1])),
                graph_time_ms(lambda i: ref.store_kv_ref(kb, vb, loc, kvs[i % n][:, 0], kvs[i % n][:, 1])),
                nbytes=nb)


def bench_gemv(rep: Report):
    from kernels.gemv import gemv
    shapes = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
              "lm_head": (4096, 128256)}
    results = {}
    for name, (K, N) in shapes.items():
        nbytes = N * K * 2
        ws = [torch.randn(N, K, dtype=DT, device="cuda") for _ in range(copies_for(nbytes, cap=8))]
        for M in (1, 4):
            x = torch.randn(M, K, dtype=DT, device="cuda")
            t_tr = graph_time_ms(lambda i: gemv(x, ws[i % len(ws)]))
            t_cb = graph_time_ms(lambda i: torch.matmul(x, ws[i % len(ws)].t()))
            rep.add("gemv", f"M={M} {name} {K}x{N}", t_tr, t_cb, nbytes=nbytes, torch_name="cuBLAS")
            results[(name, M)] = t_cb / t_tr
        del ws
    return results


def _pool(batch: int, ctx: int, copies: int):
    """KV pools (copies of K and V, [slots, HKV, D]) and the req_to_token table of `batch` requests of `ctx` tokens,
    each request's tokens in one run of slots (a fresh pool's prefill; slot 0..15 left out: padding)."""
    slots = batch * ctx + 16
    kbs = [torch.randn(slots, HKV, D, dtype=DT, device="cuda") for _ in range(copies)]
    vbs = [torch.randn(slots, HKV, D, dtype=DT, device="cuda") for _ in range(copies)]
    r2t = torch.zeros(batch + 1, ctx, dtype=torch.int32, device="cuda")
    r2t[1:] = torch.arange(16, slots, dtype=torch.int32, device="cuda").view(batch, ctx)
    return kbs, vbs, r2t, torch.arange(1, batch + 1, device="cuda")


def bench_decode(rep: Report):
    from kernels.attention.triton_decode import decode_attention, num_kv_splits_for, plan_max_kv_splits
    F = torch.nn.functional
    # (256, 640): the throughput workload's late decode steps (256 rows of 512 + 128 tokens).
    for B, ctx in [(1, 1024), (1, 8192), (64, 1024), (64, 8192), (256, 640)]:
        kv_bytes = 2 * B * ctx * HKV * D * 2
        kbs, vbs, r2t, req = _pool(B, ctx, copies_for(kv_bytes))
        seq = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
        q = torch.randn(B, HQ, D, dtype=DT, device="cuda")
        ms = plan_max_kv_splits(B, HKV)
        splits = num_kv_splits_for(seq, ms)
        mid_o = torch.empty(B, HQ, ms, D, dtype=torch.float32, device="cuda")
        mid_lse = torch.empty(B, HQ, ms, dtype=torch.float32, device="cuda")
        out = torch.empty_like(q)
        n = len(kbs)

        def tri(i):
            decode_attention(q, kbs[i % n], vbs[i % n], r2t, req, seq, splits, ms, D ** -0.5, out=out,
                             mid_o=mid_o, mid_lse=mid_lse)

        def ref(i):  # gather the paged context densely, then SDPA
            idx = r2t[req, :ctx].long()
            k = kbs[i % n][idx].transpose(1, 2)
            v = vbs[i % n][idx].transpose(1, 2)
            return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)
        rep.add("decode", f"B={B} ctx={ctx}", graph_time_ms(tri), graph_time_ms(ref, reps=5),
                nbytes=kv_bytes, torch_name="gather+SDPA")
        del kbs, vbs


def bench_extend(rep: Report):
    from kernels.attention.triton_extend import extend_attention
    F = torch.nn.functional
    for prefix, ext in [(0, 8192), (4096, 4096)]:
        total = prefix + ext
        kbs, vbs, r2t, req = _pool(1, total, 1)
        q = torch.randn(ext, HQ, D, dtype=DT, device="cuda")
        k = kbs[0][16 + prefix:16 + total]
        v = vbs[0][16 + prefix:16 + total]
        i32 = lambda x: torch.tensor([x], dtype=torch.int32, device="cuda")  # noqa: E731
        pl, el, sl = i32(prefix), i32(ext), i32(0)
        out = torch.empty_like(q)
        pairs = ext * prefix + ext * (ext + 1) / 2
        flops = 4 * HQ * D * pairs

        def tri(i):
            extend_attention(q, k, v, kbs[0], vbs[0], r2t, req, pl, el, sl, ext, D ** -0.5, out=out)

        kf, vf = kbs[0][16:16 + total].transpose(0, 1)[None], vbs[0][16:16 + total].transpose(0, 1)[None]
        qf = q.transpose(0, 1)[None]
        if prefix == 0:
            def ref(i):
                return F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, enable_gqa=True)
        else:
            mask = (torch.arange(total, device="cuda")[None] <= torch.arange(prefix, total, device="cuda")[:, None])

            def ref(i):
                return F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, enable_gqa=True)
        rep.add("extend", f"prefix={prefix} new={ext}", graph_time_ms(tri), graph_time_ms(ref, reps=5),
                flops=flops, torch_name="SDPA")
        del kbs, vbs


def bench_fusions(rep: Report):
    """The decode fusions against the launches they replace, at Llama-3.1-8B decode shapes (batch 1
    and 64): rope + KV store in one kernel vs rope then store_kv; the down GEMV reading gate|up vs
    silu_and_mul then the GEMV (the gated load serves one row; several rows run silu_and_mul first); single-launch decode
    attention vs the same one split merged by stage 2 (the backend uses it when max_kv_splits == 1)."""
    from kernels.activation import silu_and_mul
    from kernels.attention.triton_decode import decode_attention, num_kv_splits_for
    from kernels.gemv import gemv
    from kernels.kv_store import store_kv
    from kernels.reference import rope_cos_sin_cache
    from kernels.rope import apply_rope, apply_rope_and_store_kv

    inv = 1.0 / (500000 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D))
    cache = rope_cos_sin_cache(inv, 131072)
    for T in (1, 64):
        n = copies_for(T * (HQ + 2 * HKV) * D * 2)
        qkvs = [torch.randn(T, (HQ + 2 * HKV) * D, dtype=DT, device="cuda") for _ in range(n)]
        kb = torch.zeros(4096, HKV, D, dtype=DT, device="cuda")
        vb = torch.zeros_like(kb)
        loc = torch.randperm(kb.shape[0], device="cuda")[:T]
        pos = torch.randint(0, 131072, (T,), device="cuda")

        def views(qkv):
            return (qkv[:, :HQ * D], qkv[:, HQ * D:(HQ + HKV) * D].view(T, HKV, D),
                    qkv[:, (HQ + HKV) * D:].view(T, HKV, D))

        def unfused(i):
            q, k, v = views(qkvs[i % n])
            apply_rope(q, k, pos, cache, D)
            store_kv(kb, vb, loc, k, v)

        nb = T * ((2 * HQ + 4 * HKV) * D * 2 + D * 4)
        rep.add("rope+kv", f"T={T}", graph_time_ms(lambda i: apply_rope_and_store_kv(*views(qkvs[i % n]), pos, cache,
                                                                                      D, kb, vb, loc)),
                graph_time_ms(unfused), nbytes=nb, torch_name="rope;store")

    K, N = INTER, HIDDEN
    ws = [torch.randn(N, K, dtype=DT, device="cuda") for _ in range(copies_for(N * K * 2, cap=8))]
    h = torch.randn(1, 2 * K, dtype=DT, device="cuda")
    rep.add("down+silu", f"M=1 {K}x{N}", graph_time_ms(lambda i: gemv(h, ws[i % len(ws)], silu_mul=True)),
            graph_time_ms(lambda i: gemv(silu_and_mul(h), ws[i % len(ws)])), nbytes=N * K * 2,
            torch_name="silu;gemv")
    del ws

    for B, ctx in [(1, 1024), (64, 1024), (64, 4096), (128, 1024)]:  # the plan gives 1 split from B=67 on H200
        kv_bytes = 2 * B * ctx * HKV * D * 2
        kbs, vbs, r2t, req = _pool(B, ctx, copies_for(kv_bytes))
        seq = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
        q = torch.randn(B, HQ, D, dtype=DT, device="cuda")
        splits = num_kv_splits_for(seq, 1)
        zero = torch.zeros_like(seq)
        mid_o = torch.empty(B, HQ, 1, D, dtype=torch.float32, device="cuda")
        mid_lse = torch.empty(B, HQ, 1, dtype=torch.float32, device="cuda")
        out = torch.empty_like(q)
        n = len(kbs)

        def one(i, two_stage):
            decode_attention(q, kbs[i % n], vbs[i % n], r2t, req, seq, splits, 1, D ** -0.5, out=out,
                             **(dict(mid_o=mid_o, mid_lse=mid_lse, kv_start=zero) if two_stage else {}))
        rep.add("decode1", f"B={B} ctx={ctx} 1 split", graph_time_ms(lambda i: one(i, False)),
                graph_time_ms(lambda i: one(i, True)), nbytes=kv_bytes, torch_name="2-stage")
        del kbs, vbs


def tune(budget_s: float = 150.0) -> None:
    """Sweep GemvConfig per Llama shape (cold L2) and extend-attention tiles; print the best of each."""
    import itertools

    from kernels.attention.triton_extend import extend_attention, extend_block_sizes
    from kernels.gemv import GemvConfig, default_config, gemv
    t_end = time.time() + budget_s
    for M in (1, 4):
        for K, N in [(4096, 4096), (14336, 4096), (4096, 6144), (4096, 28672), (4096, 128256)]:
            nbytes = N * K * 2
            ws = [torch.randn(N, K, dtype=DT, device="cuda") for _ in range(copies_for(nbytes, cap=8))]
            x = torch.randn(M, K, dtype=DT, device="cuda")
            gbs = lambda t: nbytes / t / 1e6  # noqa: E731
            t_cb = graph_time_ms(lambda i: torch.matmul(x, ws[i % len(ws)].t()), reps=9, target_ms=2)
            t_def = graph_time_ms(lambda i: gemv(x, ws[i % len(ws)]), reps=9, target_ms=2)
            best = (t_def, default_config(M, N, K))
            space = (itertools.product([8, 16, 32], [256, 512, 1024], [1], [2, 4, 8]) if M == 1 else
                     itertools.product([16, 32, 64], [128, 256, 512], [1], [4, 8]))
            for bn, bk, sk, nw in space:
                if time.time() > t_end or bn * bk > 32768:
                    continue
                cfg = GemvConfig(bn, bk, sk, nw)
                t = graph_time_ms(lambda i: gemv(x, ws[i % len(ws)], config=cfg), reps=9, target_ms=2)
                if t < best[0]:
                    best = (t, cfg)
            print(f"tune gemv M={M} K={K} N={N}: cuBLAS {gbs(t_cb):.0f} GB/s, default {gbs(t_def):.0f} GB/s, "
                  f"best {gbs(best[0]):.0f} GB/s with {best[1]}", flush=True)
            del ws
    ext = 8192
    kbs, vbs, r2t, req = _pool(1, ext, 1)
    q = torch.randn(ext, HQ, D, dtype=DT, device="cuda")
    k, v = kbs[0][16:16 + ext], vbs[0][16:16 + ext]
    zero = torch.zeros(1, dtype=torch.int32, device="cuda")
    n_new = torch.full((1,), ext, dtype=torch.int32, device="cuda")
    flops = 4 * HQ * D * ext * (ext + 1) / 2
    t_end = time.time() + 60
    for cfg in [extend_block_sizes(D, DT), (128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3),
                (128, 32, 4, 3), (64, 32, 4, 4), (128, 64, 8, 4)]:
        if time.time() > t_end:
            break
        try:
            t = graph_time_ms(lambda i: extend_attention(q, k, v, kbs[0], vbs[0], r2t, req, zero, n_new, zero,
                                                         ext, D ** -0.5, config=cfg), reps=5)
            print(f"tune extend {cfg}: {flops / t / 1e9:.0f} TFLOP/s", flush=True)
        except Exception as e:  # e.g. out of shared memory
            print(f"tune extend {cfg}: failed {type(e).__name__}", flush=True)


PARTS = ("elementwise", "gemv", "decode", "extend", "fusions")


def parse_parts(module: str, doc: str, parts, argv, *extra: tuple[str, dict]):
    """A GPU benchmark's command line: PART names out of `parts` (default: all), --out, and `extra` (flag, kwargs)
    options. The parsed args, or None (said why) without a CUDA GPU."""
    import argparse
    ap = argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="*", metavar="PART", help=f"any of {', '.join(parts)} (default: all)")
    for flag, kwargs in extra:
        ap.add_argument(flag, **kwargs)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench-out"))
    args = ap.parse_args(argv)
    if set(args.parts) - set(parts):
        ap.error(f"unknown part {sorted(set(args.parts) - set(parts))[0]!r}; parts: {', '.join(parts)}")
    if not torch.cuda.is_available():
        print(f"{module} needs a CUDA GPU")
        return None
    return args


def main(argv=None) -> int:
    args = parse_parts("bench.kernels", __doc__, PARTS, argv,
                       ("--tune", dict(action="store_true", help="sweep block choices on this GPU instead")))
    if args is None:
        return 1
    t0 = time.time()
    torch.manual_seed(0)
    ceil = measure_ceilings()
    print(f"{torch.cuda.get_device_name()}: copy {ceil['copy_GBps']:.0f} GB/s, "
          f"bf16 matmul {ceil['matmul_TFLOPs']:.0f} TFLOP/s", flush=True)
    rep = Report(ceil)
    if args.tune:
        tune()
        return 0
    fns = {"elementwise": bench_elementwise, "gemv": bench_gemv, "decode": bench_decode, "extend": bench_extend,
           "fusions": bench_fusions}
    for name in args.parts or PARTS:
        fns[name](rep)
        torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "date": time.strftime("%Y-%m-%d"),
              "ceilings": ceil, "rows": rep.rows, "seconds": time.time() - t0}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kernels.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n# kernels on {result['device']} (copy {ceil['copy_GBps']:.0f} GB/s, "
          f"matmul {ceil['matmul_TFLOPs']:.0f} TFLOP/s), {result['seconds']:.0f} s")
    print(rep.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
