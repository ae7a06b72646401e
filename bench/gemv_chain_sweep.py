"""GEMV tiles chosen where they run: a Llama-8B decode layer's norms and four GEMVs, x 32 layers, in one
CUDA graph with programmatic dependent launch, bf16 and FP8 weights. One shape's tile is varied at a time
(the others at their defaults); the chain's time is what counts, since with PDL a GEMV overlaps its
neighbours and the best tile alone is not the best tile in the chain.

    python -m bench.gemv_chain_sweep [--dtypes bf16,fp8] [--budget 400] [--pre-tiles-study]

--pre-tiles-study: only the chain at the default tiles with 1 and 2 weight tiles loaded before the PDL wait,
alternated 1, 2, 1, 2.
--fp8-row-study: FP8 weights in the one-row kernel (kernels.gemv.FP8_ROW_KERNEL) against the general kernel,
then the row kernel's FP8 tiles swept shape by shape.
--fp8-down-study: FP8 down_proj's tiles alone, the whole budget on that shape; the pick for kernels.gemv.FP8_DOWN_TILE.
(The packed-register, 256-byte, f16 tensor-core and W8A8 FP8 studies of 2026-12-05 went with their kernels:
bench/RESULTS.md.)
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time

import torch

from bench.kernels import graph_time_ms
from kernels._utils import set_pdl
from kernels.gemv import GemvConfig, default_config, fp8_tile, gemv
from kernels.norm import rms_norm

HIDDEN, INTER, QKV = 4096, 14336, 6144
LAYERS = 32
SHAPES = {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
CANDIDATES = [(4, 2048, 2), (8, 512, 2), (8, 512, 4), (8, 1024, 2), (8, 1024, 4), (8, 2048, 4), (8, 4096, 8),
              (16, 256, 4), (16, 512, 4), (16, 1024, 4), (16, 2048, 8), (32, 256, 4), (32, 512, 4)]


def build(dtype: str):
    from shared.models.quantization import quantize_per_channel
    layers = []
    for _ in range(LAYERS):
        ws = {}
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            ws[name] = quantize_per_channel(w.float()) if dtype == "fp8" else (w, None)
            del w
        layers.append(ws)
    return layers


def chain_ms(layers, cfgs: dict) -> float:
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    nw = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)

    def fn(i):
        h = x
        for ws in layers:
            hn, _ = rms_norm(h, nw, 1e-5, res)
            qkv = gemv(hn, ws["qkv"][0], scale=ws["qkv"][1], config=cfgs.get("qkv"))
            o = gemv(qkv[:, :HIDDEN], ws["o"][0], scale=ws["o"][1], config=cfgs.get("o"))
            hn, _ = rms_norm(o, nw, 1e-5, res)
            gu = gemv(hn, ws["gate_up"][0], scale=ws["gate_up"][1], config=cfgs.get("gate_up"))
            h = gemv(gu, ws["down"][0], scale=ws["down"][1], config=cfgs.get("down"), silu_mul=True)
    return graph_time_ms(fn, reps=7, target_ms=15)


def fits(bn, bk, warps) -> bool:
    return bn * bk // (32 * warps) <= 128


def sweep_shapes(time_us, base: dict, ref_us: float, cands, share: float) -> tuple[dict, list]:
    """Each shape's candidate tiles (cands(name, n, k)) timed in the chain one shape at a time, the others at `base`,
    for at most `share` seconds a shape; time_us(cfgs) is the chain's time in µs and ref_us the time the picks must
    beat. Returns the best tile per shape (its base tile where none beat ref_us) and every timing as rows."""
    best, rows = {nm: (ref_us, base[nm]) for nm in SHAPES}, []
    for name, (n, k) in SHAPES.items():
        t_shape = time.time()
        for cfg in cands(name, n, k):
            if time.time() - t_shape > share:
                break
            if cfg == base[name]:
                continue
            try:
                t = time_us({**base, name: cfg})
            except Exception as e:  # a tile that does not compile or fit
                print(f"  {name} {cfg}: {type(e).__name__}", flush=True)
                continue
            rows.append({"shape": name, "cfg": dataclasses.asdict(cfg), "chain_us": t})
            if t < best[name][0]:
                best[name] = (t, cfg)
        print(f"  {name}: default {base[name]} -> best {best[name][1]} chain {best[name][0]:.0f} us "
              f"({(ref_us - best[name][0]) / LAYERS:+.2f} us per layer)", flush=True)
    return {nm: b[1] for nm, b in best.items()}, rows


def alternate(layers, named: dict, rounds: int = 2) -> dict:
    """The chain at each of `named`'s tile sets ({label: {shape: GemvConfig}}) in turn, `rounds` times:
    {label: [us]}."""
    times = {key: [] for key in named}
    for _ in range(rounds):
        for key, cfgs in named.items():
            times[key].append(chain_ms(layers, cfgs) * 1e3)
    return times


def alternate_then_sweep(layers, named: dict, base: str, cands, budget: float, t0: float) -> dict:
    """The chain at each of `named`'s tile sets ({label: {shape: GemvConfig}}) alternated twice; then cands(name, n, k)
    swept shape by shape from named[base] (sweep_shapes), and the picks alternated twice against every set.
    Returns the times, the sweep's rows, the final alternation and the picks."""
    nbytes = sum(w.numel() * w.element_size() for ws in layers for w, _ in ws.values())

    def rates(runs: dict) -> str:
        return ", ".join(f"{k} {nbytes / min(v) / 1e3:.0f}" for k, v in runs.items())
    times = alternate(layers, named)
    print(f"chain alternated, us: {json.dumps(times)} ({rates(times)} GB/s)", flush=True)
    share = max(0.0, budget - (time.time() - t0)) / len(SHAPES)
    picks, rows = sweep_shapes(lambda cfgs: chain_ms(layers, cfgs) * 1e3, named[base], min(times[base]), cands,
                               share)
    final = alternate(layers, {**named, "picks": picks})
    print(f"picks alternated with {', '.join(named)}, us: {json.dumps(final)} ({rates(final)} GB/s)", flush=True)
    return {"times": times, "rows": rows, "final": final,
            "picks": {nm: dataclasses.asdict(c) for nm, c in picks.items()}}


def fp8_down_candidates() -> list[str]:
    """FP8 down_proj tiles for --fp8-down-study (kernels.gemv.fp8_tile specs), the neighbourhood of (16, 2048, 8 warps,
    K unsplit) first (the engine's tile when the study was written; 16 warps since its 12-05 run): the general kernel
    at 32-128 weights a thread a loop step, K unsplit or split in 2 (tickets), one or two tiles before the PDL wait;
    the one-row kernel's FP8 tiles; the general kernel split in 4. (sm_90: at 8 warps that tile takes 108 registers,
    two programs an SM; at 16 warps 64.)"""
    def general(splits):
        return [f"{bn}:{bk}:{warps}:{split}:{pre}:0"
                for bn, bk, warps in itertools.product((16, 8, 32), (2048, 1024, 4096), (8, 4, 16))
                if 32 <= bn * bk // (32 * warps) <= 128
                for split, pre in itertools.product(splits, (1, 2))]
    # The row kernel at 128 weights a thread a loop step (two tiles in flight: sm_90 compiles (8, 1024, 2) to 157
    # registers, (8, 2048, 4) to 202, (4, 4096, 4) to 255; the 256-weight (8, 2048, 2) spills).
    row = [f"{bn}:{bk}:{warps}:{split}:2:1" for bn, bk, warps in ((8, 1024, 2), (4, 2048, 2), (16, 1024, 4),
                                                                  (8, 2048, 4), (4, 4096, 4)) for split in (1, 2)]
    return general((1, 2)) + row + general((4,))  # four splits last: the sweep may run out of budget first


def fp8_down_study(budget: float, t0: float, out_dir: str) -> dict:
    """FP8's down_proj, the laggard of the H100's 12-05 trace (2.59 TB/s where bf16's reads 2.99): the chain with
    fp8_down_candidates() swept on that shape alone (the whole budget), the three fastest alternated twice with the
    engine's tiles, and the winner (by its best time, if it beats the engine's by 0.5%) written to
    OUT/fp8_down_pick.txt for the batch-1 A/B (kernels.gemv.FP8_DOWN_TILE)."""
    layers = build("fp8")
    engine = {nm: default_config(1, n, k, 1) for nm, (n, k) in SHAPES.items()}
    spec_of = {fp8_tile(s): s for s in fp8_down_candidates()}
    base = min(chain_ms(layers, engine) * 1e3 for _ in range(2))
    print(f"engine tiles: chain {base:.0f} us; {len(spec_of)} down_proj tiles to try", flush=True)
    share = max(0.0, budget - (time.time() - t0) - 30)  # the final alternation's time kept back
    _, rows = sweep_shapes(lambda cfgs: chain_ms(layers, cfgs) * 1e3, engine, base,
                           lambda name, n, k: list(spec_of) if name == "down" else [], share)
    top = [spec_of[GemvConfig(**r["cfg"])] for r in sorted(rows, key=lambda r: r["chain_us"])[:3]]
    final = alternate(layers, {"engine": engine, **{key: {**engine, "down": fp8_tile(key)} for key in top}})
    print(f"fastest down_proj tiles alternated with the engine's, us: {json.dumps(final)}", flush=True)
    best = min(top, key=lambda k: min(final[k]), default="")
    pick = best if best and min(final[best]) < 0.995 * min(final["engine"]) else ""
    print(f"pick: {pick or 'none (the engine tile stays)'}", flush=True)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "fp8_down_pick.txt"), "w") as f:
            f.write(pick)
    del layers
    torch.cuda.empty_cache()
    return {"rows": rows, "final": final, "pick": pick}


def fp32_math_config(n: int, k: int) -> GemvConfig:
    """The FP8 one-row GEMV's tiles before f16 math (fp32 math, two tiles before the PDL wait), for comparison."""
    bn, bk, warps = (8, 1024, 4) if n <= 4096 else (8, 512, 4) if n <= 8192 else (8, 256, 2)
    return GemvConfig(bn, bk, 1, warps, pre_tiles=2)


def f16_math_study(budget: float, t0: float) -> dict:
    """FP8 rows: f16 math at its default tiles against fp32 math at its former ones (accuracy per shape
    against the dequantized weights, the chain alternated), then f16 math's tiles swept shape by shape."""
    from kernels.reference import fp8_linear_ref
    layers = build("fp8")
    nbytes = sum(w.numel() * w.element_size() for ws in layers for w, _ in ws.values())
    fp32 = {nm: fp32_math_config(n, k) for nm, (n, k) in SHAPES.items()}
    check = {}
    for name, (n, k) in SHAPES.items():
        w, sc = layers[0][name]
        for mag in (1.0, 100.0):
            x = (torch.randn(1, k, device="cuda") * mag).to(torch.bfloat16)
            ref = fp8_linear_ref(x.float(), w, sc)
            check[f"{name} |x|~{mag:g}"] = {
                key: float((gemv(x, w, scale=sc, config=cfg).float() - ref).abs().max() / ref.abs().max())
                for key, cfg in (("fp32_math", fp32[name]), ("f16_math", None))}
    print(f"accuracy (max error / max output): {json.dumps(check)}", flush=True)
    times = {"fp32_math": [], "f16_math": []}
    for _ in range(3):
        times["fp32_math"].append(chain_ms(layers, fp32) * 1e3)
        times["f16_math"].append(chain_ms(layers, {}) * 1e3)
    print(f"fp8 chain, alternated, us: {json.dumps(times)} ({nbytes / min(times['fp32_math']) / 1e3:.0f} vs "
          f"{nbytes / min(times['f16_math']) / 1e3:.0f} GB/s)", flush=True)
    cands = [(8, 512, 4), (8, 1024, 4), (8, 2048, 4), (16, 512, 4), (16, 1024, 4), (16, 1024, 8), (16, 2048, 8),
             (32, 1024, 8)]
    defaults = {nm: default_config(1, n, k, 1) for nm, (n, k) in SHAPES.items()}
    share = max(0.0, budget - (time.time() - t0)) / len(SHAPES)
    picks, rows = sweep_shapes(lambda cfgs: chain_ms(layers, cfgs) * 1e3, defaults, min(times["f16_math"]),
                               lambda name, n, k: [GemvConfig(bn, bk, split, warps, f16_math=True)
                                                   for bn, bk, warps in cands for split in (1, 2)
                                                   if bk <= k and not (split > 1 and n > 8192)], share)
    return {"check": check, "times": times, "rows": rows,
            "picks": {nm: dataclasses.asdict(c) for nm, c in picks.items()}}


# The one-row kernel's tiles: (block_n, block_k, warps, narrow accumulators, tiles before the PDL wait, fold).
ROW_CANDIDATES = [(4, 2048, 2, False, 2, 1), (8, 1024, 2, False, 2, 1), (8, 512, 2, False, 2, 1),
                  (2, 4096, 2, False, 2, 1), (2, 2048, 1, False, 2, 1), (4, 1024, 1, False, 2, 1),
                  (4, 1024, 2, False, 2, 1), (2, 2048, 2, False, 2, 1), (4, 2048, 2, True, 2, 1),
                  (4, 4096, 4, True, 2, 1), (8, 2048, 4, True, 2, 1), (16, 1024, 4, True, 2, 1),
                  (2, 4096, 2, True, 2, 1), (8, 1024, 2, True, 2, 1), (4, 2048, 2, False, 1, 1),
                  (8, 1024, 2, False, 1, 1), (4, 1024, 2, True, 2, 2), (8, 512, 2, True, 2, 2)]


def row_study(budget: float, t0: float) -> dict:
    """bf16 weights: the one-row kernel (x in w's register layout, no shared-memory round trip a tile) at its
    default tiles against the general kernel at the tiles it had, the 32-layer chain alternated; then the row
    kernel's tiles swept shape by shape (the others at their defaults), and the best picks alternated against
    the general kernel and the defaults."""
    layers = build("bf16")
    former = {"qkv": GemvConfig(8, 512, 1, 4, pre_tiles=2), "o": GemvConfig(4, 2048, 1, 2, pre_tiles=2),
              "gate_up": GemvConfig(16, 256, 1, 4, pre_tiles=2), "down": GemvConfig(8, 1024, 1, 2, pre_tiles=2)}
    general = {nm: dataclasses.replace(c, row_kernel=False) for nm, c in former.items()}
    row = {nm: default_config(1, n, k, 2) for nm, (n, k) in SHAPES.items()}

    def cands(name: str, k: int) -> list[GemvConfig]:
        return [dataclasses.replace(row[name], evict_first=False)] + [
            GemvConfig(bn, bk, 1, warps, pre_tiles=pre, fold=fold, narrow=narrow)
            for bn, bk, warps, narrow, pre, fold in ROW_CANDIDATES if bk <= k]
    return _general_against_row(layers, general, row, cands, budget, t0)


# FP8 weights in the one-row kernel (f16 math, 8 weights a thread a load): (block_n, block_k, warps, pre, fold).
FP8_ROW_CANDIDATES = [(8, 2048, 4, 2, 1), (8, 1024, 2, 2, 1), (8, 1024, 2, 2, 2), (4, 2048, 2, 2, 1),
                      (4, 4096, 4, 1, 1), (2, 4096, 2, 2, 1), (16, 1024, 4, 2, 1), (16, 2048, 8, 1, 1),
                      (8, 4096, 8, 1, 1), (4, 1024, 1, 2, 1), (8, 512, 2, 2, 2), (16, 512, 4, 2, 1),
                      (2, 2048, 1, 2, 1), (4, 2048, 4, 2, 1)]


def fp8_row_study(budget: float, t0: float) -> dict:
    """FP8 weights: the one-row kernel (x and w in one register layout) at its default tiles against the general
    kernel (the engine's FP8 path), then the row kernel's tiles swept shape by shape (the general kernel's among
    them) and the picks alternated against both."""
    import kernels.gemv as kg
    layers = build("fp8")
    general = {nm: default_config(1, n, k, 1) for nm, (n, k) in SHAPES.items()}
    assert not any(c.row_kernel for c in general.values()), "FP8_ROW_KERNEL is on: the general kernel is the baseline"
    kg.FP8_ROW_KERNEL = True
    try:
        row = {nm: default_config(1, n, k, 1) for nm, (n, k) in SHAPES.items()}
    finally:
        kg.FP8_ROW_KERNEL = False

    def cands(name: str, k: int) -> list[GemvConfig]:  # the general kernel's tiles in the row kernel first
        return [dataclasses.replace(general[name], row_kernel=True)] + [
            GemvConfig(bn, bk, 1, warps, pre_tiles=pre, fold=fold, f16_math=True)
            for bn, bk, warps, pre, fold in FP8_ROW_CANDIDATES if bk <= k]
    return _general_against_row(layers, general, row, cands, budget, t0)


def _general_against_row(layers, general: dict, row: dict, cands, budget: float, t0: float) -> dict:
    """Accuracy per shape against the dequantized weights, the chain with every shape on the general kernel and
    on the row kernel alternated, then cands(name, k) tried one shape at a time (the others at `row`), the best
    picks alternated against both."""
    from kernels.reference import fp8_linear_ref
    check = {}
    for name, (n, k) in SHAPES.items():
        w, sc = layers[0][name]
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        ref = fp8_linear_ref(x.float(), w, sc) if sc is not None else x.float() @ w.float().t()
        check[name] = {key: float((gemv(x, w, scale=sc, config=cfg[name]).float() - ref).abs().max() / ref.abs().max())
                       for key, cfg in (("general", general), ("row", row))}
    print(f"accuracy (max error / max output): {json.dumps(check)}", flush=True)
    out = alternate_then_sweep(layers, {"general": general, "row": row}, "row", lambda name, n, k: cands(name, k),
                               budget, t0)
    del layers
    torch.cuda.empty_cache()
    return {"check": check, **out}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--budget", type=float, default=400)
    ap.add_argument("--pre-tiles-study", action="store_true")
    ap.add_argument("--f16-math-study", action="store_true",
                    help="FP8 only: the one-row GEMV multiplying in f16 (GemvConfig.f16_math) against fp32 math, "
                         "accuracy per shape, the chain alternated, then its tiles swept shape by shape")
    ap.add_argument("--row-study", action="store_true",
                    help="bf16: the one-row kernel against the general one (chain alternated), then its tiles swept")
    ap.add_argument("--fp8-row-study", action="store_true",
                    help="FP8: the one-row kernel against the general one (chain alternated), then its tiles swept")
    ap.add_argument("--fp8-down-study", action="store_true",
                    help="FP8: down_proj's tiles swept in the chain (general and one-row kernels, split K, tiles "
                         "before the PDL wait); the pick written to OUT/fp8_down_pick.txt")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args()
    set_pdl(True)
    t0 = time.time()
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M"), "runs": {}}
    if args.pre_tiles_study:
        for dtype in args.dtypes.split(","):
            layers = build(dtype)
            wb = 1 if dtype == "fp8" else 2
            nbytes = sum(w.numel() * w.element_size() for ws in layers for w, _ in ws.values())
            times = {1: [], 2: []}
            for pre in (1, 2, 1, 2):
                cfgs = {nm: dataclasses.replace(default_config(1, n, k, wb), pre_tiles=pre)
                        for nm, (n, k) in SHAPES.items()}
                times[pre].append(chain_ms(layers, cfgs) * 1e3)
            print(f"{dtype}: chain us, 1 tile before the wait {times[1]}, 2 tiles {times[2]} "
                  f"({nbytes / min(times[2]) / 1e3:.0f} vs {nbytes / min(times[1]) / 1e3:.0f} GB/s)", flush=True)
            result["runs"][f"{dtype} pre_tiles"] = times
            del layers
            torch.cuda.empty_cache()
    if args.f16_math_study:
        result["runs"]["f16_math"] = f16_math_study(args.budget, t0)
    if args.row_study:
        result["runs"]["row"] = row_study(args.budget, t0)
    if args.fp8_row_study:
        result["runs"]["fp8_row"] = fp8_row_study(args.budget, t0)
    if args.fp8_down_study:
        result["runs"]["fp8_down"] = fp8_down_study(args.budget, t0, args.out)
    studies = args.pre_tiles_study or args.f16_math_study or args.row_study or args.fp8_row_study or args.fp8_down_study
    for dtype in ([] if studies else args.dtypes.split(",")):
        layers = build(dtype)
        wb = 1 if dtype == "fp8" else 2
        nbytes = sum(w.numel() * w.element_size() for ws in layers for w, _ in ws.values())
        base = chain_ms(layers, {})
        print(f"{dtype}: default tiles {base * 1e3:.0f} us for the chain ({nbytes / base / 1e6:.0f} GB/s)", flush=True)
        defaults = {nm: default_config(1, n, k, wb) for nm, (n, k) in SHAPES.items()}

        def cands(name, n, k):  # the tile varied, the rest as the default has it (pre-tiles, f16 math...)
            return [dataclasses.replace(defaults[name], block_n=bn, block_k=bk, split_k=split, num_warps=warps)
                    for bn, bk, warps in CANDIDATES for split in (1, 2)
                    if fits(bn, bk, warps) and bk <= k and not (split > 1 and n > 8192)]
        share = max(0.0, args.budget - (time.time() - t0)) / len(SHAPES)
        picks, rows = sweep_shapes(lambda cfgs: chain_ms(layers, cfgs) * 1e3, defaults, base * 1e3, cands, share)
        final = chain_ms(layers, picks)
        again = chain_ms(layers, {})
        print(f"{dtype}: all best {final * 1e3:.0f} us vs default {again * 1e3:.0f} us "
              f"({nbytes / final / 1e6:.0f} vs {nbytes / again / 1e6:.0f} GB/s)", flush=True)
        result["runs"][dtype] = {"default_us": [base * 1e3, again * 1e3], "best_us": final * 1e3,
                                 "best": {nm: dataclasses.asdict(c) for nm, c in picks.items()}, "rows": rows}
        del layers
        torch.cuda.empty_cache()
    if args.out:
        with open(os.path.join(args.out, "gemv_chain_sweep.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
