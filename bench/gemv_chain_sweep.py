"""GEMV tiles chosen where they run: a Llama-8B decode layer's norms and four GEMVs, x 32 layers, in one
CUDA graph with programmatic dependent launch, bf16 and FP8 weights. One shape's tile is varied at a time
(the others at their defaults); the chain's time is what counts, since with PDL a GEMV overlaps its
neighbours and the best tile alone is not the best tile in the chain.

    python -m bench.gemv_chain_sweep [--dtypes bf16,fp8] [--budget 400] [--pre-tiles-study]

--pre-tiles-study: only the chain at the default tiles with 1 and 2 weight tiles loaded before the PDL wait,
alternated 1, 2, 1, 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

from bench.kernels import graph_time_ms
from kernels._utils import set_pdl
from kernels.gemv import GemvConfig, default_config, gemv, gemv_w8a8, w8a8_config
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


@dataclasses.dataclass(frozen=True)
class W8A8:
    """A shape run by gemv_w8a8 (FP8 activations on tensor cores) with these tiles and pipeline depth."""
    cfg: GemvConfig
    stages: int = 3


def _gemv(x, w, scale, cfg, silu_mul=False):
    if isinstance(cfg, W8A8):
        return gemv_w8a8(x, w, scale, config=cfg.cfg, num_stages=cfg.stages, silu_mul=silu_mul)
    return gemv(x, w, scale=scale, config=cfg, silu_mul=silu_mul)


def chain_ms(layers, cfgs: dict) -> float:
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    nw = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)

    def fn(i):
        h = x
        for ws in layers:
            hn, _ = rms_norm(h, nw, 1e-5, res)
            qkv = _gemv(hn, *ws["qkv"], cfgs.get("qkv"))
            o = _gemv(qkv[:, :HIDDEN], *ws["o"], cfgs.get("o"))
            hn, _ = rms_norm(o, nw, 1e-5, res)
            gu = _gemv(hn, *ws["gate_up"], cfgs.get("gate_up"))
            h = _gemv(gu, *ws["down"], cfgs.get("down"), silu_mul=True)
    return graph_time_ms(fn, reps=7, target_ms=15)


def fits(bn, bk, warps) -> bool:
    return bn * bk // (32 * warps) <= 128


def w8a8_check(layers) -> dict:
    """gemv_w8a8 against torch._scaled_mm on the same per-token-quantized row (the W8A8 reference), and the
    weight-only GEMV against the dequantized weights, per shape: the largest error over the largest output."""
    from kernels.reference import fp8_linear_ref, quantize_fp8_per_token
    out = {}
    for name, (n, k) in SHAPES.items():
        w, s = layers[0][name]
        x = torch.randn(1, 2 * k if name == "down" else k, device="cuda", dtype=torch.bfloat16)
        xin = x
        if name == "down":
            xin = (torch.nn.functional.silu(x[:, :k].float()) * x[:, k:].float()).to(torch.bfloat16)
        q, sx = quantize_fp8_per_token(xin)
        ref = torch._scaled_mm(q, w.t(), scale_a=sx, scale_b=s.view(1, n), out_dtype=torch.float32)
        y = gemv_w8a8(x, w, s, silu_mul=name == "down").float()
        wo = gemv(x, w, scale=s, silu_mul=name == "down").float()
        deq = fp8_linear_ref(xin, w, s).float()
        out[name] = {"w8a8_vs_scaled_mm": ((y - ref).abs().max() / ref.abs().max()).item(),
                     "w8a8_vs_dequantized": ((y - deq).abs().max() / deq.abs().max()).item(),
                     "weight_only_vs_dequantized": ((wo - deq).abs().max() / deq.abs().max()).item()}
    return out


def w8a8_study(budget: float, t0: float) -> dict:
    layers = build("fp8")
    nbytes = sum(w.numel() * w.element_size() for ws in layers for w, _ in ws.values())
    check = w8a8_check(layers)
    print(f"w8a8 accuracy (max error / max output): {json.dumps(check)}", flush=True)
    base = chain_ms(layers, {})
    defaults = {nm: W8A8(w8a8_config(n, k)) for nm, (n, k) in SHAPES.items()}
    all_default = chain_ms(layers, defaults)
    print(f"fp8 chain: weight-only GEMV {base * 1e3:.0f} us ({nbytes / base / 1e6:.0f} GB/s), w8a8 default tiles "
          f"{all_default * 1e3:.0f} us ({nbytes / all_default / 1e6:.0f} GB/s)", flush=True)
    best, rows = {}, []
    per_shape = max(0.0, budget - (time.time() - t0)) / len(SHAPES)
    for name, (n, k) in SHAPES.items():
        best[name] = (base, None)
        t_shape = time.time()
        d = w8a8_config(n, k)
        cands = []
        for stages in (3, 4):
            for bk in (128, 256, 64):
                for bn in (64, 128):
                    for split in sorted({max(1, d.split_k // 2), d.split_k, d.split_k * 2}):
                        if bk <= k and split * bk <= k:
                            cands.append(W8A8(GemvConfig(bn, bk, split, 4), stages))
        for c in cands:
            if time.time() - t_shape > per_shape:
                break
            try:
                t = chain_ms(layers, {name: c})
            except Exception as e:  # a tile that does not compile or fit in shared memory
                print(f"  {name} {c}: {type(e).__name__}", flush=True)
                continue
            rows.append({"shape": name, "cfg": [c.cfg.block_n, c.cfg.block_k, c.cfg.split_k, c.stages],
                         "chain_us": t * 1e3})
            if t < best[name][0]:
                best[name] = (t, c)
        print(f"  {name}: weight-only chain {base * 1e3:.0f} us -> best w8a8 {best[name][1]} "
              f"{best[name][0] * 1e3:.0f} us ({(base - best[name][0]) / LAYERS * 1e3:+.2f} us per layer)", flush=True)
    picks = {nm: b[1] for nm, b in best.items() if b[1] is not None}
    times = {"weight_only": [], "w8a8_best": [], "w8a8_default": []}
    for _ in range(2):
        times["weight_only"].append(chain_ms(layers, {}) * 1e3)
        times["w8a8_best"].append(chain_ms(layers, picks) * 1e3)
        times["w8a8_default"].append(chain_ms(layers, defaults) * 1e3)
    print(f"fp8 chain, alternated twice, us: {json.dumps(times)}; best picks "
          f"{ {nm: [*vars(c.cfg).values(), c.stages] for nm, c in picks.items()} }", flush=True)
    return {"check": check, "times": times, "rows": rows,
            "picks": {nm: [*vars(c.cfg).values(), c.stages] for nm, c in picks.items()}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--budget", type=float, default=400)
    ap.add_argument("--pre-tiles-study", action="store_true")
    ap.add_argument("--w8a8-study", action="store_true",
                    help="FP8 only: each shape on gemv_w8a8 (activations quantized per token, tensor cores) with "
                         "its tiles swept, against the weight-only FP8 GEMV; then every shape at its best")
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
    if args.w8a8_study:
        result["runs"]["w8a8"] = w8a8_study(args.budget, t0)
    for dtype in ([] if args.pre_tiles_study or args.w8a8_study else args.dtypes.split(",")):
        layers = build(dtype)
        wb = 1 if dtype == "fp8" else 2
        nbytes = sum(w.numel() * w.element_size() for ws in layers for w, _ in ws.values())
        base = chain_ms(layers, {})
        print(f"{dtype}: default tiles {base * 1e3:.0f} us for the chain ({nbytes / base / 1e6:.0f} GB/s)", flush=True)
        best = {}
        rows = []
        for name, (n, k) in SHAPES.items():
            d = default_config(1, n, k, wb)
            best[name] = (base, d)
            for bn, bk, warps in CANDIDATES:
                for split in (1, 2):
                    if not fits(bn, bk, warps) or bk > k or (split > 1 and n > 8192):
                        continue
                    if time.time() - t0 > args.budget:
                        break
                    cfg = GemvConfig(bn, bk, split, warps)
                    if cfg == d:
                        continue
                    try:
                        t = chain_ms(layers, {name: cfg})
                    except Exception as e:  # a tile that does not compile or fit
                        print(f"  {name} {cfg}: {type(e).__name__}", flush=True)
                        continue
                    rows.append({"shape": name, "cfg": [bn, bk, split, warps], "chain_us": t * 1e3})
                    if t < best[name][0]:
                        best[name] = (t, cfg)
            print(f"  {name}: default {d} -> best {best[name][1]} chain {best[name][0] * 1e3:.0f} us "
                  f"({(base - best[name][0]) / LAYERS * 1e3:+.2f} us per layer)", flush=True)
        final = chain_ms(layers, {nm: b[1] for nm, b in best.items()})
        again = chain_ms(layers, {})
        print(f"{dtype}: all best {final * 1e3:.0f} us vs default {again * 1e3:.0f} us "
              f"({nbytes / final / 1e6:.0f} vs {nbytes / again / 1e6:.0f} GB/s)", flush=True)
        result["runs"][dtype] = {"default_us": [base * 1e3, again * 1e3], "best_us": final * 1e3,
                                 "best": {nm: list(vars(b[1]).values()) for nm, b in best.items()}, "rows": rows}
        del layers
        torch.cuda.empty_cache()
    if args.out:
        with open(os.path.join(args.out, "gemv_chain_sweep.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
