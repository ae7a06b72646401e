"""GPU microbenchmark of shared-prefix (cascade) decode attention against plain decode attention, at the
shape of issue 11's goal: batch 256 in groups of 16 sharing a 2,048-token prefix, each with its own
152-token suffix (a 128-token question and 24 decoded tokens), Llama-3.1-8B heads (32 q / 8 KV, D 128).

    python -m bench.cascade_kernels [--batch 256 --group 16 --prefix 2048 --suffix 152]

Slots are laid out as the engine lays them out: a group's prefix contiguous, each request's question
contiguous, decoded tokens interleaved across the batch (one slot per request per step). Times are
CUDA-graph replays (bench.kernels.graph_time_ms), one layer's attention. Prints per-part times and the
bytes each part must read, so a part far from the copy bandwidth stands out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.kernels import DT, HKV, HQ, D, graph_time_ms  # noqa: E402
from kernels.attention.triton_cascade import (CascadePlan, CascadeShape, cascade_decode_attention,  # noqa: E402
                                             plan_cascade_host, prefix_attention)
from kernels.attention.triton_decode import decode_attention, num_kv_splits_for, plan_max_kv_splits  # noqa: E402


def layout(batch: int, group: int, prefix: int, question: int, decoded: int, dev, pool: int = 0, seed: int = 0):
    """req_to_token rows for the shared batch (rows [0, batch)) and for the same batch without prefixes
    (rows [batch, 2 batch)), the slot count, and the groups. pool > 0: every contiguous run (a prefix, a
    question, a step's decoded tokens) starts at a random place in a pool of that many slots, as in a
    long-running server's pool, instead of packed from slot 1."""
    groups = batch // group
    ctx = prefix + question + decoded
    r2t = torch.zeros((2 * batch, ctx + 64), dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed)
    runs = [prefix] * groups + [question] * (2 * batch) + [2 * batch] * decoded
    if pool:
        # Disjoint runs at random places: shuffle the runs and the gaps between them.
        assert pool >= sum(runs) + 1
        order = torch.randperm(len(runs), generator=gen).tolist()
        cuts = sorted(torch.randint(0, pool - sum(runs), (len(runs),), generator=gen).tolist())
        starts, used = [0] * len(runs), 1
        for k, i in enumerate(order):
            starts[i] = used + cuts[k]
            used += runs[i]
        nxt = pool
    else:
        starts, acc = [], 1
        for n in runs:
            starts.append(acc)
            acc += n
        nxt = acc
    it = iter(starts)
    pre = [torch.arange(s, s + prefix, dtype=torch.int32) for _, s in zip(range(groups), it)]
    qs = [torch.arange(s, s + question, dtype=torch.int32) for _, s in zip(range(2 * batch), it)]
    dec = torch.stack([torch.arange(s, s + 2 * batch, dtype=torch.int32) for _, s in zip(range(decoded), it)]).t() \
        if decoded else torch.zeros((2 * batch, 0), dtype=torch.int32)
    for b in range(batch):  # rows [0, batch): shared prefix; rows [batch, 2 batch): no prefix
        r2t[b, :prefix] = pre[b // group]
        r2t[b, prefix:prefix + question] = qs[b]
        r2t[b, prefix + question:ctx] = dec[b]
        r2t[batch + b, :question] = qs[batch + b]
        r2t[batch + b, question:question + decoded] = dec[batch + b]
    return r2t.to(dev), nxt, [(prefix, list(range(g * group, (g + 1) * group))) for g in range(groups)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--question", type=int, default=128)
    ap.add_argument("--decoded", type=int, default=24)
    ap.add_argument("--splits", default="2,4,8,16", help="prefix splits to try")
    ap.add_argument("--pool", type=int, default=0, help="slots in the KV pool, runs placed at random (0: packed)")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    B, G, P = args.batch, args.group, args.prefix
    r2t, slots, groups = layout(B, G, P, args.question, args.decoded, dev, args.pool)
    k = torch.randn((slots, HKV, D), dtype=DT, device=dev)
    v = torch.randn_like(k)
    q = torch.randn((B, HQ, D), dtype=DT, device=dev)
    scale = D ** -0.5
    suffix = args.question + args.decoded
    rows_shared = torch.arange(B, dtype=torch.int64, device=dev)
    rows_alone = rows_shared + B
    lens_shared = torch.full((B,), P + suffix, dtype=torch.int32, device=dev)
    lens_alone = torch.full((B,), suffix, dtype=torch.int32, device=dev)
    ms = plan_max_kv_splits(B, HKV)
    kv_bytes = 2 * HKV * D * k.element_size()  # one token's K and V, one layer
    res = {"args": vars(args), "max_kv_splits": ms}

    def time_it(name, fn, nbytes):
        t = graph_time_ms(fn) * 1e3
        res[name] = {"us": t, "GBps": nbytes / t / 1e3}
        print(f"{name:34s} {t:8.1f} us  {nbytes / 1e6:8.1f} MB  {nbytes / t / 1e3:7.0f} GB/s", flush=True)

    def plain(rows, lens, n):
        splits = num_kv_splits_for(lens, ms)
        mid_o = torch.empty((B, HQ, ms, D), dtype=torch.float32, device=dev)
        mid_lse = torch.empty((B, HQ, ms), dtype=torch.float32, device=dev)
        out = torch.empty_like(q)
        return lambda i: decode_attention(q, k, v, r2t, rows, lens, splits, ms, scale, out=out, mid_o=mid_o,
                                          mid_lse=mid_lse)

    time_it("plain, shared prefix", plain(rows_shared, lens_shared, B), B * (P + suffix) * kv_bytes)
    time_it("plain, no prefix", plain(rows_alone, lens_alone, B), B * suffix * kv_bytes)
    gqa = HQ // HKV
    auto = plan_cascade_host(groups, rows_shared.tolist(), B, HKV, gqa)
    res["auto_splits"] = auto.splits[0]
    variants = [(f"{ps} splits", CascadeShape(auto.num_groups, ps, auto.block_r), ps)
                for ps in [int(x) for x in args.splits.split(",") if x]]
    variants.append((f"graph plan ({auto.splits[0]} splits)", CascadeShape.for_graph(B, gqa, 4), None))
    for name, shape, ps in variants:
        host = plan_cascade_host(groups, rows_shared.tolist(), B, HKV, gqa, shape)
        if ps is not None:
            host.splits = [ps] * host.num_groups
        plan = CascadePlan.empty(shape, B, dev)
        plan.load(host, B)
        cols = ms + plan.prefix_splits
        splits = num_kv_splits_for(lens_shared - plan.kv_start, ms)
        mid_o = torch.empty((B, HQ, cols, D), dtype=torch.float32, device=dev)
        mid_lse = torch.empty((B, HQ, cols), dtype=torch.float32, device=dev)
        time_it(f"prefix part, {name}", lambda i: prefix_attention(q, k, v, r2t, plan, ms, scale, mid_o, mid_lse),
                len(groups) * P * kv_bytes)
        out = torch.empty_like(q)
        time_it(f"suffix part, {name}", lambda i: decode_attention(
            q, k, v, r2t, rows_shared, lens_shared, splits, ms, scale, out=out, mid_o=mid_o, mid_lse=mid_lse,
            kv_start=plan.kv_start), B * suffix * kv_bytes)
        time_it(f"cascade, {name}", lambda i: cascade_decode_attention(
            q, k, v, r2t, rows_shared, lens_shared, plan, splits, ms, scale, mid_o=mid_o, mid_lse=mid_lse, out=out),
            (len(groups) * P + B * suffix) * kv_bytes)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "cascade_kernels.json"), "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
