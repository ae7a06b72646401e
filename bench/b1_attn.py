"""Batch-1 decode attention, the split chunks merged in one launch (the last program of each request and
KV head) against two (a stage-2 kernel per layer), on one GPU in one process (~2-3 minutes on an H200).

    python -m bench.b1_attn [--rounds 2] [--variants two,one,one@16] [--contexts 512,2048,3584] [--steps 256]
                            [--kernel-contexts 512,1024,2048,4096] [--split-caps 8,16,32,64] [--no-kernels]

1. Kernels (~30 s): decode attention alone, Llama-3.1-8B shape (32 query heads, 8 KV heads, d 128, bf16),
   32 calls (a layer each, KV beyond L2) in one CUDA graph with PDL, per context and, at batch 1, split
   cap (the backend's plan there is min(64, context / 64) chunks; at batch 16, 8), both merges: µs per
   layer, and how far the one-launch output is from the two-launch one (the merges sum in other
   orders: a bf16 ulp).
2. Engines: the engine's batch-1 step (wall, overlap on) and its CUDA graph's replay, for one request
   decoding `steps` tokens after a prompt of each context, engines alternated variant by variant
   (two / one / two / one ...) in this process. A variant is `two` or `one`, optionally `@N`: the split
   plan capped at N chunks per request (bench-only: the backend's plan_max_kv_splits wrapped).

One JSON line per measurement. Last, a line per variant after the first (the baseline): PASS when its
step is shorter than the baseline's at every context, averaged over the rounds (what making it the
default asks), else FAIL. Greedy tokens are compared too but do not decide: a bf16 ulp in one attention output may
change a dummy model's argmax some tokens later.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import torch

from bench.common import GREEDY, b1_engine, drive, graph_replay_ms, log, random_prompts
from bench.kernels import DT, HKV, HQ, D, _pool, copies_for, graph_time_ms

LAYERS = 32


def parse_args(argv=None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default="two,one,one@16",
                    help="comma-separated: two|one[@max chunks per request]; the first is the baseline")
    ap.add_argument("--contexts", type=ints, default=[512, 2048, 3584], help="prompt tokens of the engine runs")
    ap.add_argument("--steps", type=int, default=256, help="tokens decoded per engine run")
    ap.add_argument("--kernel-contexts", type=ints, default=[512, 1024, 2048, 4096])
    ap.add_argument("--kernel-batches", type=ints, default=[1, 16], help="batch 1: every split cap; others: the plan's")
    ap.add_argument("--split-caps", type=ints, default=[8, 16, 32, 64], help="kernel part: chunks per request at most")
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--no-engines", action="store_true")
    args = ap.parse_args(argv)
    try:
        args.variants = [parse_variant(v) for v in args.variants.split(",")]
    except ValueError as e:
        ap.error(str(e))
    if len(args.variants) < 2:
        ap.error("--variants needs a baseline and at least one other")
    if max(args.contexts) + args.steps > 4096:
        ap.error("a context plus --steps must stay within the engine's 4096 tokens")
    return args


def parse_variant(text: str) -> tuple[bool, int | None]:
    """'one@16' -> (one launch, split cap 16); 'two' -> (False, None)."""
    merge, _, cap = text.partition("@")
    if merge not in ("one", "two"):
        raise ValueError(f"variant {text!r}: one or two, optionally @N")
    return merge == "one", int(cap) if cap else None


def variant_name(v: tuple[bool, int | None]) -> str:
    return ("one" if v[0] else "two") + (f"@{v[1]}" if v[1] else "")


def bench_kernels(args) -> list[dict]:
    from kernels._utils import set_pdl
    from kernels.attention.triton_decode import MAX_KV_SPLITS, decode_attention, num_kv_splits_for, plan_max_kv_splits
    set_pdl(True)
    rows = []
    for B in args.kernel_batches:
        # Batch 1 with the split cap varied; larger batches at the backend's own plan.
        caps = args.split_caps if B == 1 else [MAX_KV_SPLITS]
        for ctx in args.kernel_contexts:
            n = copies_for(2 * B * ctx * HKV * D * 2, cap=LAYERS)  # the layers' KV together well beyond L2
            kbs, vbs, r2t, req = _pool(B, ctx, n)
            seq = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
            q = torch.randn(B, HQ, D, dtype=DT, device="cuda")
            out = torch.empty_like(q)
            tickets = torch.zeros(B * HKV, dtype=torch.int32, device="cuda")
            for cap in caps:
                ms = plan_max_kv_splits(B, HKV, cap)
                splits = num_kv_splits_for(seq, ms)
                mid_o = torch.empty(B, HQ, ms, D, dtype=torch.float32, device="cuda")
                mid_lse = torch.empty(B, HQ, ms, dtype=torch.float32, device="cuda")
                ref = None
                for one in (False, True):
                    def layers(i, tk=tickets if one else None):
                        for layer in range(LAYERS):
                            decode_attention(q, kbs[layer % n], vbs[layer % n], r2t, req, seq, splits, ms, D ** -0.5,
                                             out=out, mid_o=mid_o, mid_lse=mid_lse, tickets=tk)
                    layers(0)
                    torch.cuda.synchronize()
                    if ref is None:
                        ref = out.clone()
                    row = {"part": "kernel", "batch": B, "context": ctx, "split_cap": cap, "chunks": int(splits[0]),
                           "merge": "one" if one else "two",
                           "us_per_layer": graph_time_ms(layers, reps=9) * 1e3 / LAYERS,
                           "max_diff_vs_two": float((out.float() - ref.float()).abs().max()),
                           "tickets_clean": not bool(tickets.any())}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            del kbs, vbs
            torch.cuda.empty_cache()
    return rows


def kernel_table(rows: list[dict]) -> list[str]:
    """Per batch and context: µs per layer, two launches / one, for each split cap."""
    lines = []
    for B, ctx in dict.fromkeys((r["batch"], r["context"]) for r in rows):
        cells = []
        for cap in dict.fromkeys(r["split_cap"] for r in rows if (r["batch"], r["context"]) == (B, ctx)):
            t = {r["merge"]: r for r in rows if (r["batch"], r["context"], r["split_cap"]) == (B, ctx, cap)}
            cells.append(f"{t['one']['chunks']} chunks {t['two']['us_per_layer']:.2f}/{t['one']['us_per_layer']:.2f}")
        lines.append(f"  batch {B} ctx {ctx}: " + ", ".join(cells))
    return lines


def run_engine(variant, args, rnd: int) -> list[dict]:
    import shared.models.attention.triton_backend as tb
    one, cap = variant
    plan = tb.plan_max_kv_splits
    if cap:
        tb.plan_max_kv_splits = lambda b, h, c=tb.MAX_KV_SPLITS: plan(b, h, min(c, cap))
    rows = []
    try:
        eng = b1_engine(True, one_launch_decode_attention=one)
        try:
            for i, ctx in enumerate(args.contexts):
                st = drive(eng, random_prompts(1, ctx, 400, 100 + i), {**GREEDY, "max_new_tokens": args.steps})
                toks = [t for o in st.outputs.values() for t in o.token_ids]
                rows.append({"part": "engine", "variant": variant_name(variant), "round": rnd, "context": ctx,
                             "step_ms": st.wall_s / max(1, st.steps) * 1e3,
                             "replay_ms": graph_replay_ms(eng.runner.graph_runner), "tokens": toks})
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "tokens"}), flush=True)
        finally:
            eng.stop()
            del eng
            gc.collect()
            torch.cuda.empty_cache()
    finally:
        tb.plan_max_kv_splits = plan
    return rows


def verdict(rows: list[dict], base, variant, contexts) -> tuple[bool, str]:
    """Whether `variant`'s mean step is below the baseline's at every context, and the figures."""
    def mean_step(v, ctx):
        return statistics.mean(r["step_ms"] for r in rows if r["variant"] == variant_name(v) and r["context"] == ctx)
    steps = {c: (mean_step(variant, c), mean_step(base, c)) for c in contexts}
    text = "; ".join(f"{c}: {new:.3f} vs {old:.3f} ms ({new / old:.3f})" for c, (new, old) in steps.items())
    return (all(new < old for new, old in steps.values()),
            f"{variant_name(variant)} against {variant_name(base)}, batch-1 step by context: {text}")


def token_agreement(rows: list[dict], variants) -> dict:
    """Per variant and context: whether its greedy tokens equal the baseline's first round, and where
    they first differ."""
    ref = {r["context"]: r["tokens"] for r in rows if r["variant"] == variant_name(variants[0]) and r["round"] == 0}
    res = {}
    for r in rows:
        a, b = r["tokens"], ref[r["context"]]
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))
        res[f"{r['variant']} round {r['round']} ctx {r['context']}"] = "same" if first is None else f"differs at {first}"
    return res


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/b1_attn.py needs a CUDA GPU")
        return 1
    t0 = time.time()
    log(f"{torch.cuda.get_device_name()}, variants {[variant_name(v) for v in args.variants]}")
    if not args.no_kernels:
        krows = bench_kernels(args)
        log("kernels, µs per layer, two launches / one launch:")
        for line in kernel_table(krows):
            log(line)
        bad = [r for r in krows if not r["tickets_clean"] or r["max_diff_vs_two"] > 0.05]
        if bad:
            print(f"FAIL: one-launch kernel output or counters wrong: {bad}")
            return 1
    if args.no_engines:
        return 0
    rows = []
    for rnd in range(args.rounds):
        for v in args.variants:
            rows += run_engine(v, args, rnd)
    print(json.dumps({"part": "tokens", **token_agreement(rows, args.variants)}), flush=True)
    log(f"{time.time() - t0:.0f} s")
    for v in args.variants[1:]:
        ok, text = verdict(rows, args.variants[0], v, args.contexts)
        print(("PASS: " if ok else "FAIL: ") + text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
