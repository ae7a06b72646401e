"""Speculative decoding on the reference models (bench.reference_models), spec on against spec off in one run, and
the cost of a verification pass on the Llama-3.1-8B shape (random weights).

    python -m bench.spec [--models /tmp/refmodels] [--methods NGRAM,STANDALONE] [--batches 1,8,32,256] [--out DIR]

Workloads, greedy, --new-tokens (256) each: code completion (a held-out file's head of --prompt-tokens, 512) and
prose (held-out text ending a third of the way into a docstring or comment block, up to 512 tokens: less copyable
than code). Batch 1 runs --b1-prompts prompts one after another; batch B submits B prompts at once. Each method runs
in an engine of its own (--speculative-algorithm METHOD; STANDALONE drafts with the reference draft,
--speculative-draft-model-path), beside the same engine without speculation. Per run: mean acceptance length
(tokens a request gained per step that gave it any, its first excluded), tokens/s per user (each request's decode
tokens over the time from its first token to its last, averaged), TPOT p50 / p99 (the same span over the tokens,
across requests).

Goals, each a PASS/FAIL line, the best method of each row: batch 1 code >= 2.0x tokens/s per user, batch 1 prose
>= 1.5x, batch 32 >= 1.3x (each workload), batch 256 >= 0.98x (every method and workload: never a loss where
speculation cannot pay); exactness: each method's greedy tokens equal spec off's (same batch) on >= 99% of the
prompts (mismatches listed, with spec off's own batch-1 vs batch-B differences as the numerics floor); on the 8B
shape a verification pass of 4 draft tokens at batch 1 <= 1.10x a decode step (k = 1..8, batches 1 and 32: the
model runner's extend pass of k + 1 tokens a request over a cached context, logits of every row, against its decode
step). Writes spec.json to --out. Missing models are trained first (bench.reference_models' defaults, --tiny's with
--tiny: a CPU smoke run in seconds).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import time

import numpy as np
import torch

from bench import reference_corpus as corpus
from bench import reference_models
from bench.common import GREEDY, SHAPES, drive, log, median, model_dir, pct, start_engine

METHODS = ("NGRAM", "STANDALONE", "EAGLE")
GOAL_B1 = {"code": 2.0, "prose": 1.5}
GOAL_B32 = 1.3
GOAL_B256 = 0.98
GOAL_EXACT = 0.99
GOAL_VERIFY_K4_B1 = 1.10


def spec_flags_known() -> bool:
    """Whether the engine takes SGLang's speculative-decoding settings (EngineConfig.speculative_algorithm)."""
    from shared.engine.config import EngineConfig

    return "speculative_algorithm" in {f.name for f in dataclasses.fields(EngineConfig)}


def spec_config(method: str | None, models: str, steps: int | None, draft_tokens: int | None) -> dict:
    """The engine settings of a method (None: off); steps / draft tokens left to the engine's defaults when None."""
    if method is None:
        return {}
    cfg = {"speculative_algorithm": method}
    if steps is not None:
        cfg["speculative_num_steps"] = steps
    if draft_tokens is not None:
        cfg["speculative_num_draft_tokens"] = draft_tokens
    if method == "STANDALONE":
        cfg["speculative_draft_model_path"] = os.path.join(models, "draft")
    return cfg


def _free(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def request_figures(events: list[tuple[float, int]]) -> dict:
    """Per request, from its outputs' (time, tokens): decode tokens/s, TPOT (s) and acceptance length, the first
    output (the prefill's token) excluded."""
    if len(events) < 2:
        return {}
    tokens = sum(n for _, n in events[1:])
    span = events[-1][0] - events[0][0]
    return {"tok_s": tokens / span if span > 0 else float("nan"), "tpot_s": span / tokens,
            "accept": tokens / (len(events) - 1)}


def run_workload(eng, prompts: list[list[int]], batch: int, b1_prompts: int, new_tokens: int) -> dict:
    """One batch size of one workload: batch 1 runs b1_prompts prompts one at a time; batch B the first B at once."""
    sampling = {**GREEDY, "max_new_tokens": new_tokens}
    if batch == 1:
        runs = [drive(eng, [p], sampling, request={"stream": True}) for p in prompts[:b1_prompts]]
        outs = [r.ordered[0] for r in runs]
        events = [r.token_events[0] for r in runs]
        wall = sum(r.wall_s for r in runs)
    else:
        st = drive(eng, prompts[:batch], sampling, request={"stream": True})
        outs, events, wall = st.ordered, st.token_events, st.wall_s
    figs = [f for f in map(request_figures, events) if f]
    tpots = [f["tpot_s"] for f in figs]
    return {"tokens": [list(o.token_ids) for o in outs], "requests": len(outs), "wall_s": wall,
            "tok_s_per_user": float(np.mean([f["tok_s"] for f in figs])) if figs else float("nan"),
            "accept_len": float(np.mean([f["accept"] for f in figs])) if figs else float("nan"),
            "tpot_p50_ms": pct(tpots, 0.5) * 1e3, "tpot_p99_ms": pct(tpots, 0.99) * 1e3,
            "output_tok_s": sum(len(o.token_ids) for o in outs) / wall,
            # The engine's own count (TokenOutput.spec_verify_ct, where it has one): verification passes, all requests.
            "verify_passes": sum(getattr(o, "spec_verify_ct", 0) for o in outs)}


def run_method(method: str | None, args, workloads: dict, cuda: bool) -> dict:
    from shared.engine.config import EngineConfig
    from shared.tokenizer import Tokenizer

    target = os.path.join(args.models, "target")
    mb = max(args.batches)
    # The pool holds every request of the largest batch whole (prompt, output, a step's drafts): no retraction.
    pool = mb * (args.prompt_tokens + args.new_tokens + (args.num_draft_tokens or 16) + 8) + 4096
    ec = EngineConfig(model_path=target, max_running_requests=mb, cuda_graph=cuda, cuda_graph_max_bs=mb,
                      max_total_tokens=pool, **spec_config(method, args.models, args.num_steps, args.num_draft_tokens))
    name = method or "off"
    log(f"engine: speculation {name}")
    res: dict = {}
    eng = start_engine(ec, Tokenizer.load(target), res)
    try:
        warm = workloads["code"][:2]  # batch 1 then 2: the first drafts and verifications of each kind are behind
        drive(eng, warm[:1], {**GREEDY, "max_new_tokens": 32})
        drive(eng, warm, {**GREEDY, "max_new_tokens": 16})
        eng.cache.reset()
        for wl, prompts in workloads.items():
            for b in args.batches:
                r = run_workload(eng, prompts, b, args.b1_prompts, args.new_tokens)
                eng.cache.reset()
                res[f"{wl}/{b}"] = r
                log(f"  {name} {wl} batch {b}: {r['tok_s_per_user']:.1f} tok/s per user, accept {r['accept_len']:.2f}, "
                    f"TPOT p50 {r['tpot_p50_ms']:.2f} ms p99 {r['tpot_p99_ms']:.2f} ms")
        res["engine_info_speculative"] = eng.info().get("speculative")  # the engine's own counters, if it has any
    finally:
        eng.stop()
    del eng
    _free(cuda)
    return res


def exactness(off: dict, on: dict) -> tuple[int, int, list]:
    """(prompts equal, prompts compared, mismatches: (run, prompt index, first differing position))."""
    same, n, bad = 0, 0, []
    for key, r in off.items():
        if not isinstance(r, dict) or "tokens" not in r or key not in on:
            continue
        for i, (a, b) in enumerate(zip(r["tokens"], on[key]["tokens"])):
            n += 1
            if a == b:
                same += 1
            else:
                bad.append((key, i, next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))))
    return same, n, bad


def batch_floor(off: dict, batches: list[int]) -> dict:
    """Spec off against itself: batch B's tokens vs batch 1's on the prompts both ran (numerics that change with the
    batch, which no speculation causes)."""
    out = {}
    for wl in ("code", "prose"):
        b1 = off.get(f"{wl}/1", {}).get("tokens", [])
        for b in batches:
            if b != 1 and f"{wl}/{b}" in off:
                toks = off[f"{wl}/{b}"]["tokens"]
                out[f"{wl}/{b}"] = sum(a != c for a, c in zip(b1, toks))
    return out


# ---------------------------------------------------------------- verification pass on the 8B shape
def verify_costs(shape: str, ks: list[int], batches: list[int], context: int, reps: int, cuda: bool) -> dict:
    """Seconds of one decode step and of one extend pass of k + 1 tokens a request (logits of every row), both over
    `context` cached tokens a request, medians of `reps` synchronized passes, on random weights of `shape`."""
    from shared.engine.config import EngineConfig
    from shared.engine.engine_loop import Engine
    from shared.models.forward_batch import ForwardBatch, ForwardMode
    from shared.tokenizer import Tokenizer

    path = model_dir(shape)
    mb = max(batches)
    ec = EngineConfig(model_path=path, load_format="dummy", max_running_requests=mb, cuda_graph_max_bs=mb,
                      max_total_tokens=mb * (context + max(ks) + 2) + 64, cuda_graph=cuda,
                      cuda_graph_max_extend_tokens=512 if mb * (max(ks) + 1) <= 512 else 2048)
    eng = Engine(ec, Tokenizer.load(path), on_output=lambda o: None)
    r = eng.runner
    dev = r.device
    vocab = SHAPES[shape]["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    out: dict = {"graphs": {}}  # per figure: whether its pass replayed a CUDA graph

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        ts = []
        for _ in range(reps):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        return median(ts)

    try:
        for b in batches:
            rows = [r.req_pool.alloc() for _ in range(b)]
            span = context + max(ks) + 1
            base = [1 + i * span for i in range(b)]  # each request's slots, consecutive (KV values: whatever is there)
            for row, s in zip(rows, base):
                r.req_pool.req_to_token[row, :span] = torch.arange(s, s + span, dtype=torch.int32, device=dev)
            loc = torch.tensor([s + context for s in base], dtype=torch.int64)

            def decode():
                out["graphs"][f"decode/{b}"] = r.graph_runner is not None and r.graph_runner.can_run(b)
                if out["graphs"][f"decode/{b}"]:
                    r.graph_runner.run(rows, [context + 1] * b, loc, loc.tolist())
                    return
                fb = ForwardBatch.build(ForwardMode.DECODE, [0] * b, rows, [context] * b, [1] * b, loc,
                                        r.req_pool.req_to_token, r.kv_pool, r.attn_backend, dev)
                r.attn_backend.init_forward_metadata(fb)
                r.model.compute_logits(r.model.forward(fb))
            with torch.inference_mode():
                out[f"decode/{b}"] = timed(decode)
                for k in ks:
                    ids = torch.randint(3, vocab, (b * (k + 1),), generator=gen).tolist()
                    locs = torch.cat([torch.arange(s + context, s + context + k + 1) for s in base])

                    def verify():
                        fb = ForwardBatch.build(ForwardMode.EXTEND, ids, rows, [context] * b, [k + 1] * b, locs,
                                                r.req_pool.req_to_token, r.kv_pool, r.attn_backend, dev)
                        g = r.extend_graphs.pick([k + 1] * b) if r.extend_graphs is not None else None
                        out["graphs"][f"verify/{b}/{k}"] = g is not None
                        if g is not None:
                            hidden = r.extend_graphs.run(fb, g)
                        else:
                            r.attn_backend.init_forward_metadata(fb)
                            hidden = r.model.forward(fb)
                        r.model.compute_logits(hidden)
                    out[f"verify/{b}/{k}"] = timed(verify)
                    log(f"  batch {b}, k={k}: verify {out[f'verify/{b}/{k}'] * 1e3:.3f} ms, decode "
                        f"{out[f'decode/{b}'] * 1e3:.3f} ms: {out[f'verify/{b}/{k}'] / out[f'decode/{b}']:.3f}x")
            for row in rows:
                r.req_pool.free(row)
    finally:
        eng.stop()
    del eng
    _free(cuda)
    return out


# ---------------------------------------------------------------- report
def verdicts(res: dict, args) -> list[str]:
    lines = []
    off = res["runs"]["off"]
    methods = [m for m in res["runs"] if m != "off"]

    def ratio(m, key):
        return res["runs"][m][key]["tok_s_per_user"] / off[key]["tok_s_per_user"]
    print(f"\n{'run':18s} {'method':11s} {'tok/s/user':>10s} {'x off':>6s} {'accept':>6s} {'TPOT p50':>9s} {'p99':>8s}")
    for key in (k for k in off if isinstance(off[k], dict) and "tokens" in off[k]):
        for m in ["off", *methods]:
            r = res["runs"][m][key]
            x = r["tok_s_per_user"] / off[key]["tok_s_per_user"]
            print(f"{key:18s} {m:11s} {r['tok_s_per_user']:10.1f} {x:6.2f} "
                  f"{r['accept_len']:6.2f} {r['tpot_p50_ms']:8.2f}ms {r['tpot_p99_ms']:7.2f}ms")
    for wl, goal in GOAL_B1.items():
        if f"{wl}/1" in off and methods:
            best = max(methods, key=lambda m: ratio(m, f"{wl}/1"))
            x = ratio(best, f"{wl}/1")
            lines.append(f"{'PASS' if x >= goal else 'FAIL'}  batch 1 {wl}: {x:.2f}x tokens/s per user with {best} "
                         f"(accept {res['runs'][best][f'{wl}/1']['accept_len']:.2f}; goal >= {goal}x)")
    for wl in ("code", "prose"):
        if f"{wl}/32" in off and methods:
            best = max(methods, key=lambda m: ratio(m, f"{wl}/32"))
            x = ratio(best, f"{wl}/32")
            lines.append(f"{'PASS' if x >= GOAL_B32 else 'FAIL'}  batch 32 {wl}: {x:.2f}x with {best} "
                         f"(goal >= {GOAL_B32}x)")
        if f"{wl}/256" in off and methods:
            worst = min(methods, key=lambda m: ratio(m, f"{wl}/256"))
            x = ratio(worst, f"{wl}/256")
            lines.append(f"{'PASS' if x >= GOAL_B256 else 'FAIL'}  batch 256 {wl}: {x:.2f}x at worst ({worst}; "
                         f"goal >= {GOAL_B256}x for every method)")
    for m in methods:
        same, n, bad = res["exactness"][m]
        frac = same / max(1, n)
        lines.append(f"{'PASS' if frac >= GOAL_EXACT else 'FAIL'}  exactness {m}: greedy tokens equal spec off's on "
                     f"{same}/{n} prompts ({100 * frac:.1f}%; goal >= {100 * GOAL_EXACT:.0f}%)"
                     + (f"; first mismatches (run, prompt, position): {bad[:6]}" if bad else ""))
    lines += [f"FAIL  {m} did not run: {e}" for m, e in res["errors"].items()]
    lines.append(f"info  spec off against itself, batch B vs batch 1 (prompts differing): {res['batch_floor']}")
    return lines


def verify_verdicts(v: dict, args) -> list[str]:
    """The verification pass's lines (bench.spec prints them after the speculation's: the 8B engine comes last)."""
    lines = []
    if v:
        for b in args.verify_batches:
            xs = ", ".join(f"k={k} {v[f'verify/{b}/{k}'] / v[f'decode/{b}']:.3f}" for k in args.verify_k)
            eager = [key for key, graph in v["graphs"].items() if not graph and key.split("/")[1] == str(b)]
            lines.append(f"info  {args.verify_shape} batch {b}: decode step {v[f'decode/{b}'] * 1e3:.3f} ms; verify "
                         f"pass / decode step: {xs}" + (f" (eager, no CUDA graph: {eager})" if eager else ""))
        if 4 in args.verify_k and 1 in args.verify_batches:
            x = v["verify/1/4"] / v["decode/1"]
            lines.append(f"{'PASS' if x <= GOAL_VERIFY_K4_B1 else 'FAIL'}  {args.verify_shape}: a verification pass of "
                         f"4 draft tokens at batch 1 costs {x:.3f}x a decode step (goal <= {GOAL_VERIFY_K4_B1})")
    return lines


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.spec", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="/tmp/refmodels", help="bench.reference_models' --out (trained if missing)")
    ap.add_argument("--tiny", action="store_true", help="tiny reference models and sizes: a CPU smoke run")
    ap.add_argument("--methods", default="NGRAM,STANDALONE", help=f"comma-separated, of {', '.join(METHODS)}")
    ap.add_argument("--batches", type=ints, default=None, help="(1,8,32,256; tiny 1,4)")
    ap.add_argument("--b1-prompts", type=int, default=None, help="prompts of the batch-1 runs (8; tiny 2)")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="(512; tiny 32)")
    ap.add_argument("--new-tokens", type=int, default=None, help="(256; tiny 12)")
    ap.add_argument("--num-steps", type=int, default=None, help="--speculative-num-steps (the engine's default)")
    ap.add_argument("--num-draft-tokens", type=int, default=None,
                    help="--speculative-num-draft-tokens (the engine's default; STANDALONE: steps + 1)")
    ap.add_argument("--verify-shape", default=None, choices=[*SHAPES, "none"], help="(llama-3.1-8b; tiny tiny)")
    ap.add_argument("--verify-k", type=ints, default=list(range(1, 9)))
    ap.add_argument("--verify-batches", type=ints, default=[1, 32])
    ap.add_argument("--verify-context", type=int, default=512)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench-out"))
    args = ap.parse_args(argv)
    defaults = dict(batches=([1, 8, 32, 256], [1, 4]), b1_prompts=(8, 2), prompt_tokens=(512, 32),
                    new_tokens=(256, 12), verify_shape=("llama-3.1-8b", "tiny"))
    for k, (full, tiny) in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, tiny if args.tiny else full)
    args.methods = [m.strip().upper() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        ap.error(f"--methods: unknown {bad} (of {', '.join(METHODS)})")
    if args.tiny:
        args.verify_k = [k for k in args.verify_k if k <= 4]
        args.verify_batches = [b for b in args.verify_batches if b <= 4] or [1]
        args.verify_context = min(args.verify_context, 32)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not spec_flags_known():
        print("bench.spec: this engine has no speculative decoding (EngineConfig lacks speculative_algorithm)")
        return 2
    cuda = torch.cuda.is_available()
    if args.tiny and not cuda:
        torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    if reference_models.finished_manifest(args.models) is None:
        log(f"no finished reference models in {args.models}: training them")
        reference_models.ensure(reference_models.parse_args(["--out", args.models] + ["--tiny"] * args.tiny))
    manifest = reference_models.finished_manifest(args.models)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(args.models, "target", "tokenizer.json"))
    held = reference_models.read_heldout(args.models)
    n = max(max(args.batches), args.b1_prompts)
    workloads = {"code": corpus.code_prompts(tok, held, n, args.prompt_tokens, args.new_tokens),
                 "prose": corpus.prose_prompts(tok, held, n, args.prompt_tokens)}
    for wl, ps in workloads.items():
        log(f"{wl}: {len(ps)} held-out prompts, {np.mean([len(p) for p in ps]):.0f} tokens on average")
        if len(ps) < n:
            raise SystemExit(f"bench.spec: only {len(ps)} held-out {wl} prompts for batch {n}: lower --batches, or "
                             f"train with more held-out text (bench.reference_models --heldout-permille)")
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "gpu": torch.cuda.get_device_name() if cuda else "cpu",
                 "models": {k: manifest["models"][k]["params"] for k in ("target", "draft")},
                 "settings": manifest["settings"], "args": {k: v for k, v in vars(args).items()}, "runs": {}}
    res["errors"] = {}
    res["runs"]["off"] = run_method(None, args, workloads, cuda)
    for m in args.methods:
        try:
            res["runs"][m] = run_method(m, args, workloads, cuda)
        except Exception as e:  # one method's failure (a refusal at start, say) leaves the others' figures
            log(f"{m} failed: {e!r}")
            res["errors"][m] = repr(e)[:500]
            _free(cuda)
    res["exactness"] = {m: exactness(res["runs"]["off"], res["runs"][m]) for m in res["runs"] if m != "off"}
    res["batch_floor"] = batch_floor(res["runs"]["off"], args.batches)
    # The speculation's verdicts first, and its JSON: a call that runs out of time in the 8B engine's start or
    # timing below keeps them.
    print("\n".join(verdicts(res, args)), flush=True)
    for run in res["runs"].values():  # the token lists stay out of the JSON: the exactness counts hold their story
        for r in run.values():
            if isinstance(r, dict):
                r.pop("tokens", None)
    write_json(res, args.out)
    if args.verify_shape != "none":
        log(f"verification pass against a decode step, {args.verify_shape} shape")
        res["verify"] = verify_costs(args.verify_shape, args.verify_k, args.verify_batches, args.verify_context,
                                     reps=20 if cuda else 3, cuda=cuda)
        print("\n".join(verify_verdicts(res["verify"], args)))
        write_json(res, args.out)
    return 0


def write_json(res: dict, out: str) -> None:
    with open(os.path.join(out, "spec.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
