"""Attention side by side: our Triton backend against FlashInfer's (the kernels SGLang runs) and torch SDPA.

    python -m bench.attention [--out DIR] [decode extend cascade]

Both backends run as the engine runs them (shared/models/attention/), on the engine's pool layout (one slot a
token), planned once before the timed calls; each figure is the median replay of a CUDA graph holding many calls
(bench.kernels.graph_time_ms; eagerly where a call cannot be captured, marked "eager"), rotating over copies of
the pool (as layers) so memory-bound cases read HBM. Shapes are Llama-3.1-8B's heads. The torch baseline gathers
the paged context densely, then runs SDPA (cuDNN/flash where torch picks them).

- decode: batch 1, 64, 256 at contexts 512 .. 32k (batch x context at most MAX_DECODE_TOKENS).
- extend: one 8k prompt with no prefix; 4k new over a cached 4k prefix; 16 requests of 256 new over 2k prefixes.
- cascade: 64 decode rows in 4 groups of 16 sharing a 4k prefix, 256 tokens each of their own: Triton's
  shared-prefix decode and FlashInfer's two-level MultiLevelCascadeAttentionWrapper, each against its plain decode.

Without flashinfer installed the FlashInfer columns stay empty (bench/fetch_flashinfer.sh; bench/gpu_run.sh kernels
--flashinfer). Prints "ratio" = FlashInfer time / Triton time (above 1: ours is faster) and writes attention.json.
JIT builds of FlashInfer's kernels happen on first use, outside the timings (~70 s on a fresh machine).
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

from bench.kernels import DT, HKV, HQ, D, copies_for, graph_time_ms, parse_parts

MAX_DECODE_TOKENS = 1 << 21  # batch x context per pool copy: 8.6 GB of bf16 K and V at these heads
DECODE = [(1, 512), (1, 1024), (1, 8192), (1, 32768), (64, 512), (64, 1024), (64, 2048), (64, 8192), (64, 32768),
          (256, 512), (256, 640), (256, 2048), (256, 8192)]
EXTEND = [(1, 0, 8192), (1, 4096, 4096), (16, 2048, 256)]  # (requests, cached prefix, new tokens each)
CASCADE = (64, 16, 4096, 256)  # rows, rows a group, shared prefix, own tokens


def timed(fn) -> tuple[float, str]:
    """(ms a call, how): graph replays, or eager calls where fn cannot be captured."""
    try:
        return graph_time_ms(fn), "graph"
    except Exception as e:  # noqa: BLE001 - any capture failure: time it eagerly instead
        torch.cuda.synchronize()
        print(f"    (not capturable: {type(e).__name__}: {str(e)[:120]}; timed eagerly)", flush=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for i in range(12):
            start.record()
            fn(i)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times[2:])[len(times[2:]) // 2], "eager"


class World:
    """A pool of `copies` layers holding `reqs` requests of `ctx` tokens each (slots in order from 16), the slot table,
    and a ForwardBatch per backend."""

    def __init__(self, reqs: int, ctx: int, copies: int):
        from shared.cache.kv_pool import KVPool
        self.reqs, self.ctx = reqs, ctx
        self.pool = KVPool(copies, HKV, D, num_pages=reqs * ctx + 16, page_size=1, dtype=DT, device="cuda")
        for k, v in zip(self.pool.k_buffers, self.pool.v_buffers):
            k.normal_()
            v.normal_()
        self.r2t = torch.zeros(reqs + 1, ctx, dtype=torch.int32, device="cuda")
        self.r2t[1:] = torch.arange(16, 16 + reqs * ctx, dtype=torch.int32, device="cuda").view(reqs, ctx)
        self.rows = list(range(1, reqs + 1))

    def batch(self, backend, prefix: int, new: int, graph: bool = False):
        from shared.models.forward_batch import ForwardBatch, ForwardMode
        mode = ForwardMode.DECODE if new == 1 and prefix else ForwardMode.EXTEND
        T = self.reqs * new
        fb = ForwardBatch.build(mode, [0] * T, self.rows, [prefix] * self.reqs, [new] * self.reqs,
                                torch.zeros(T, dtype=torch.int64), self.r2t, self.pool, backend, torch.device("cuda"))
        if graph:
            fb.seq_lens_cpu = None  # as the decode graph runner builds its batches (FlashInfer's graph wrappers)
        backend.init_forward_metadata(fb)
        return fb

    def dense(self, layer: int, ctx: int):
        idx = self.r2t[1:, :ctx].long()
        k_buf, v_buf = self.pool.get_kv(layer)
        return k_buf[idx].transpose(1, 2), v_buf[idx].transpose(1, 2)  # [B, HKV, ctx, D]


def backends() -> dict:
    from shared.models.attention import create_attention_backend
    out = {"triton": create_attention_backend("triton", HQ, HKV, D, device="cuda")}
    if importlib.util.find_spec("flashinfer") is not None:
        out["flashinfer"] = create_attention_backend("flashinfer", HQ, HKV, D, device="cuda", dtype=DT)
    return out


class Table:
    def __init__(self):
        self.rows: list[dict] = []

    def add(self, part: str, case: str, us: dict, how: dict, **extra):
        row = {"part": part, "case": case, **{f"{k}_us": v for k, v in us.items()},
               "how": how, **extra}
        if us.get("triton") and us.get("flashinfer"):
            row["ratio"] = us["flashinfer"] / us["triton"]
        self.rows.append(row)
        cells = "  ".join(f"{k} {v:9.1f} us" for k, v in us.items() if v is not None)
        print(f"  {part:8s} {case:34s} {cells}  {'' if 'ratio' not in row else format(row['ratio'], '.2f') + 'x'}",
              flush=True)

    def text(self) -> str:
        head = f"{'part':8s} {'case':34s} {'triton us':>10s} {'flashinfer us':>14s} {'torch us':>10s} {'fi/triton':>10s}"
        lines = [head, "-" * len(head)]
        for r in self.rows:
            cell = lambda k: "" if r.get(k) is None else format(r[k], ".1f")  # noqa: E731
            lines.append(f"{r['part']:8s} {r['case']:34s} {cell('triton_us'):>10s} {cell('flashinfer_us'):>14s} "
                         f"{cell('torch_us'):>10s} {'' if 'ratio' not in r else format(r['ratio'], '.2f') + 'x':>10s}")
        return "\n".join(lines)


def bench_decode(table: Table, bes: dict):
    F = torch.nn.functional
    for B, ctx in DECODE:
        if B * ctx > MAX_DECODE_TOKENS:
            continue
        kv_bytes = 2 * B * ctx * HKV * D * DT.itemsize
        w = World(B, ctx, copies_for(kv_bytes))
        n = w.pool.num_layers
        q = torch.randn(B, HQ, D, dtype=DT, device="cuda")
        us, how = {}, {}
        for name, be in bes.items():
            fb = w.batch(be, ctx - 1, 1, graph=name == "flashinfer")
            t, how[name] = timed(lambda i, be=be, fb=fb: be.forward_decode(q, i % n, fb))
            us[name] = t * 1e3

        def ref(i):
            k, v = w.dense(i % n, ctx)
            return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)
        t, how["torch"] = timed(ref)
        us["torch"] = t * 1e3
        table.add("decode", f"B={B} ctx={ctx}", us, how, GBps={k: kv_bytes / v / 1e3 for k, v in us.items()})
        del w
        torch.cuda.empty_cache()


def bench_extend(table: Table, bes: dict):
    F = torch.nn.functional
    for reqs, prefix, new in EXTEND:
        total = prefix + new
        w = World(reqs, total, 1)
        T = reqs * new
        q = torch.randn(T, HQ, D, dtype=DT, device="cuda")
        k_buf, v_buf = w.pool.get_kv(0)
        new_slots = w.r2t[1:, prefix:].reshape(-1).long()
        k, v = k_buf[new_slots].contiguous(), v_buf[new_slots].contiguous()
        flops = 4 * HQ * D * reqs * (new * prefix + new * (new + 1) / 2)
        us, how = {}, {}
        for name, be in bes.items():
            fb = w.batch(be, prefix, new)
            t, how[name] = timed(lambda i, be=be, fb=fb: be.forward_extend(q, k, v, 0, fb))
            us[name] = t * 1e3
        kd, vd = w.dense(0, total)
        qd = q.view(reqs, new, HQ, D).transpose(1, 2)
        mask = torch.arange(total, device="cuda")[None] <= torch.arange(prefix, total, device="cuda")[:, None]
        t, how["torch"] = timed(lambda i: F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=True))
        us["torch"] = t * 1e3
        table.add("extend", f"{reqs}x(prefix={prefix} new={new})", us, how,
                  TFLOPs={k: flops / v / 1e6 for k, v in us.items()})
        del w
        torch.cuda.empty_cache()


def bench_cascade(table: Table, bes: dict):
    from shared.models.attention.flashinfer_backend import indptr_of
    rows, per, prefix, own = CASCADE
    ctx = prefix + own
    w = World(rows, ctx, 1)
    for g in range(rows // per):  # every group's rows read one prefix: the first row's slots
        first = w.r2t[1 + g * per, :prefix].clone()
        w.r2t[1 + g * per:1 + (g + 1) * per, :prefix] = first
    q = torch.randn(rows, HQ, D, dtype=DT, device="cuda")
    groups = [(prefix, list(range(g * per, (g + 1) * per))) for g in range(rows // per)]
    us, how = {}, {}
    for name, be in bes.items():
        fb = w.batch(be, ctx - 1, 1, graph=name == "flashinfer")
        t, how[name] = timed(lambda i, be=be, fb=fb: be.forward_decode(q, 0, fb))
        us[name] = t * 1e3
    table.add("cascade", f"plain decode B={rows} ctx={ctx}", us, how)
    us, how = {}, {}
    tri = bes["triton"]
    fb = w.batch(tri, ctx - 1, 1)
    fb.prefix_groups = groups
    tri.init_forward_metadata(fb)
    t, how["triton"] = timed(lambda i: tri.forward_decode(q, 0, fb))
    us["triton"] = t * 1e3
    fi_be = bes.get("flashinfer")
    if fi_be is not None:
        # Two levels: each group's shared prefix (its rows' queries together), then every row's own tokens.
        wrapper = fi_be.fi.MultiLevelCascadeAttentionWrapper(2, fi_be.workspace, "NHD")
        heads = w.r2t[1::per, :prefix].reshape(-1).contiguous()
        own_slots = w.r2t[1:, prefix:].reshape(-1).contiguous()
        ng = rows // per
        wrapper.plan([indptr_of([per] * ng), indptr_of([1] * rows)], [indptr_of([prefix] * ng), indptr_of([own] * rows)],
                     [heads, own_slots], [torch.ones(ng, dtype=torch.int32), torch.ones(rows, dtype=torch.int32)],
                     HQ, HKV, D, 1, sm_scale=D ** -0.5, q_data_type=DT, kv_data_type=DT)
        k_buf, v_buf = w.pool.get_kv(0)
        pages = (k_buf.unsqueeze(1), v_buf.unsqueeze(1))
        t, how["flashinfer"] = timed(lambda i: wrapper.run(q, pages))
        us["flashinfer"] = t * 1e3
    table.add("cascade", f"{rows // per} groups x {per}, prefix {prefix}", us, how)


PARTS = {"decode": bench_decode, "extend": bench_extend, "cascade": bench_cascade}


def main(argv=None) -> int:
    args = parse_parts("bench.attention", __doc__, list(PARTS), argv)
    if args is None:
        return 1
    t0 = time.time()
    torch.manual_seed(0)
    bes = backends()
    if "flashinfer" not in bes:
        print("flashinfer is not installed: Triton and torch only (bench/fetch_flashinfer.sh)", flush=True)
    table = Table()
    with torch.inference_mode():
        for name in args.parts or list(PARTS):
            PARTS[name](table, bes)
    fi_version = bes["flashinfer"].fi.__version__ if "flashinfer" in bes else None
    seconds = time.time() - t0
    print(f"\n# attention on {torch.cuda.get_device_name()}, flashinfer {fi_version}, {seconds:.0f} s "
          f"(fi/triton above 1: ours is faster)\n{table.text()}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "flashinfer": fi_version,
         "date": time.strftime("%Y-%m-%d"), "rows": table.rows, "seconds": seconds}, indent=1))
    return 0

if __name__ == "__main__":
    sys.exit(main())
